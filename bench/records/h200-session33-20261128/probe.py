"""Do 1,024-row tool rollouts on the GPU decode what the model says? Sampler log-probs against a fresh forward."""
import sys, time
sys.path.insert(0, "src"); sys.path.insert(0, "bench")
import numpy as np
import mlx.core as mx
import tools_bench as tb
from mlx_grpo.config import build_config, parse_set
from mlx_grpo.models.model_loading import load_model
from mlx_grpo.models.forward import bucket
from mlx_grpo.rollout.engine import RolloutEngine
from mlx_grpo.rollout.multiturn import encode_prompts, multiturn_for, rollouts
from mlx_grpo.rollout.rollout_records import SamplingParams
D = sys.argv[1]
t0 = time.time()
cfg = build_config("train", "configs/prod_tools.toml", parse_set([f"dataset_path={D}/train.jsonl", "batch_size=64"]))
model, tok = load_model(cfg.model.model_name, cfg.model.model_dtype)
engine = RolloutEngine(tok, mode="copy").refresh(model)
mt = multiturn_for(cfg, tok, getattr(getattr(model, "args", None), "model_type", None))
T = cfg.rollout.max_new_tokens
params = SamplingParams(T, cfg.rollout.temperature, stop=tuple(cfg.rollout.stop))
ex_all = tb.batches(cfg, 1)[0]
prompts_all = [ids for ids, _ in encode_prompts(mt, tok, ex_all, cfg)]
print("prompt lengths", sorted(len(p) for p in prompts_all)[-5:], "mean", np.mean([len(p) for p in prompts_all]), flush=True)
order = sorted(range(64), key=lambda i: -len(prompts_all[i]))  # longest first: the capacity is the batch's longest
for B, pick in ((16, list(range(16))), (64, list(range(64))), (48, order[16:])):
    ex = [ex_all[i] for i in pick]; prompts = [prompts_all[i] for i in pick]
    keys = mx.random.split(mx.random.key(3), len(ex) * 16)
    t = time.time()
    r = rollouts(engine, mt, [(prompts, keys, ex)], 16, params, cfg.data.prefill)[0]
    sec = time.time() - t
    cap = bucket(max(len(p) for p in prompts)) + T
    ids, mask, lps = np.array(r.completion_ids), np.array(r.mask), np.array(r.sampler_logprobs)
    diffs = []
    for row in sorted(set([0, 1, len(ex) * 16 // 2, len(ex) * 16 - 1, len(ex) * 16 - 200])):
        p = prompts[row // 16]; c = ids[row].tolist()
        logits = model(mx.array([p + c]))[0, len(p) - 1:-1].astype(mx.float32)
        lp = np.array(mx.take_along_axis(logits - mx.logsumexp(logits, axis=-1, keepdims=True), mx.array(c)[:, None], axis=-1)[:, 0])
        m = mask[row] > 0
        diffs.append((row, round(float(np.abs(lp[m] - lps[row][m]).mean()), 4)))
    calls = tb.tool_use(r.transcripts)[0]
    print(f"B={B} rows={len(ex)*16} capacity={cap} cache elements={30*len(ex)*16*3*cap*64/1e9:.2f}e9 {sec:.1f}s "
          f"calls={np.mean(calls > 0):.3f} len={r.lengths.mean():.0f} |sampler-forward| per row {diffs}", flush=True)
    print("  text:", repr(r.texts[len(ex) * 16 - 1][:300]), flush=True)
print("total", time.time() - t0)
