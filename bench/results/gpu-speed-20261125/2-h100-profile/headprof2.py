"""Where the log-prob pass's time beyond the layers goes: one 64-row micro-batch (150-token prompts + 256
completion tokens) of the real model, bf16; forward pieces and fwd+bwd pieces, ms (median of 5 after 2)."""
import statistics, sys, time
import mlx.core as mx, mlx.nn as nn
from mlx_grpo.models.loading import load_model
from mlx_grpo.models import forward as F

model, tok = load_model(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct", "bfloat16")
n, P, T = 64, 150, 256
V = model.model.embed_tokens.weight.shape[0]
inputs = mx.random.randint(0, V, (n, F.bucket(P + T)))
positions = (P - 1 + mx.arange(T))[None] + mx.zeros((n, 1), mx.int32)
targets = inputs[:, P:P + T]
batch = F.PackedBatch(inputs, positions, targets, mx.ones((n, T)))
mx.eval(inputs, positions, targets)

def tm(name, fn, k=5):
    for _ in range(2): mx.eval(fn())
    ts = []
    for _ in range(k):
        mx.synchronize(); t0 = time.perf_counter(); mx.eval(fn()); mx.synchronize(); ts.append(time.perf_counter() - t0)
    print(f"{name}: {statistics.median(ts) * 1e3:.1f} ms", flush=True)

inner = model.model
tm("layers", lambda: F.hidden_states(inner, inputs))
def picked():
    h = F.hidden_states(inner, inputs)
    idx = mx.broadcast_to(positions[..., None], (n, T, h.shape[-1]))
    return mx.take_along_axis(h, idx, axis=1)
tm("layers+gather", picked)
tm("layers+gather via slice", lambda: F.hidden_states(inner, inputs)[:, P - 1:P - 1 + T])
tm("completion_logprobs (default chunks)", lambda: F.completion_logprobs(model, batch, 1.0))
tm("completion_logprobs (one chunk)", lambda: F.completion_logprobs(model, batch, 1.0, chunk_tokens=n * T))
w_dim = inner.embed_tokens.weight.shape[1]
h = mx.random.normal((n * T, w_dim)).astype(mx.bfloat16); w = inner.embed_tokens.weight; t = targets.reshape(-1)
mx.eval(h)
chunk = F.LOGIT_CHUNK_ELEMENTS // V
tm(f"head alone, linear_head_logprobs chunk {chunk}", lambda: F.linear_head_logprobs(h, w, t, 1.0, chunk))
tm("head alone, linear_head_logprobs chunk 4096", lambda: F.linear_head_logprobs(h, w, t, 1.0, 4096))
tm("head alone, token_logprobs one chunk", lambda: F.token_logprobs(h @ w.T, t, 1.0))
def vjp(c):
    return mx.vjp(lambda hh, ww: F.linear_head_logprobs(hh, ww, t, 1.0, c), [h, w], [mx.ones((n * T,))])[1]
tm(f"head fwd+bwd chunk {chunk}", lambda: vjp(chunk))
tm("head fwd+bwd chunk 4096", lambda: vjp(4096))
def loss(m, c):
    return F.completion_logprobs(m, batch, 1.0, chunk_tokens=c).sum()
g = nn.value_and_grad(model, loss)
tm("model fwd+bwd default chunks", lambda: g(model, None))
tm("model fwd+bwd chunk 4096", lambda: g(model, 4096))
def lay(m):
    return F.hidden_states(m.model, inputs)[:, P - 1:P - 1 + T].astype(mx.float32).sum()
tm("layers fwd+bwd (no head)", lambda: nn.value_and_grad(model, lay)(model))
cg = mx.compile(lambda: g(model, None), inputs=model.state, outputs=model.state)
tm("compiled model fwd+bwd default chunks", cg)
