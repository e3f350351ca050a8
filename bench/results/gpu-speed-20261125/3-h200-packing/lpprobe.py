"""logprob_pass vs its pieces on the real model, 256 rows x 256 tokens, prompts 120-250 tokens."""
import statistics, sys, time
sys.path.insert(0, "bench")
import mlx.core as mx, numpy as np
from mlx_grpo.models.loading import load_model
from grpo_bench import synthetic_rollout
from mlx_grpo.training.policy import logprob_pass
from mlx_grpo.training.microbatch import row_chunks, chunk_batch
from mlx_grpo.models.forward import completion_logprobs
model, tok = load_model("smollm2-135m-instruct", "bfloat16")
V = model.model.embed_tokens.weight.shape[0]
rng = np.random.default_rng(0)
prompts = [[int(x) for x in rng.integers(0, V, size=rng.integers(120, 250))] for _ in range(16)]
ro = synthetic_rollout(prompts, 16, 256, V, 0)
def tm(name, fn, n=5):
    for _ in range(2): fn()
    ts = []
    for _ in range(n):
        mx.synchronize(); t0 = time.perf_counter(); fn(); mx.synchronize(); ts.append(time.perf_counter() - t0)
    print(f"{name}: {statistics.median(ts) * 1e3:.1f} ms", flush=True)
for rows, tokens in ((16, 8192), (64, 32768)):
    chunks = row_chunks(ro, rows, tokens)
    batches = [chunk_batch(ro, r, 0)[0] for r in chunks]
    mx.eval([b.inputs for b in batches])
    tag = f"{rows}x{tokens} ({len(chunks)} chunks)"
    tm(f"{tag} logprob_pass", lambda: mx.eval(logprob_pass(model, ro, 1.0, rows, 0, tokens)))
    tm(f"{tag} prebuilt, eval each", lambda: [mx.eval(completion_logprobs(model, b, 1.0)) for b in batches])
    tm(f"{tag} prebuilt, one eval", lambda: mx.eval([completion_logprobs(model, b, 1.0) for b in batches]))
    tm(f"{tag} pack only", lambda: mx.eval([chunk_batch(ro, r, 0)[0].inputs for r in chunks]))
    tm(f"{tag} row_chunks only", lambda: row_chunks(ro, rows, tokens))
    print(tag, "widths", [b.inputs.shape for b in batches][:4], flush=True)
