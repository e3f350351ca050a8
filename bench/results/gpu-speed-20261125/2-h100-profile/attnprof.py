"""One layer's pieces, forward and forward+backward, at B=64, L=448, 9 query / 3 kv heads of 64, bf16:
fused SDPA vs the unfused formula, the MLP, RMSNorm, RoPE (ms, median of 5 after 2)."""
import statistics, time, mlx.core as mx, mlx.nn as nn
B, H, KV, L, D = 64, 9, 3, 448, 64
q = mx.random.normal((B, H, L, D)).astype(mx.bfloat16); k = mx.random.normal((B, KV, L, D)).astype(mx.bfloat16)
v = mx.random.normal((B, KV, L, D)).astype(mx.bfloat16); mx.eval(q, k, v)
def tm(name, fn, n=5):
    for _ in range(2): mx.eval(fn())
    ts = []
    for _ in range(n):
        mx.synchronize(); t0 = time.perf_counter(); mx.eval(fn()); mx.synchronize(); ts.append(time.perf_counter() - t0)
    print(f"{name}: {statistics.median(ts) * 1e3:.2f} ms", flush=True)
sdpa = lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
tm("sdpa fwd", lambda: sdpa(q, k, v))
tm("sdpa fwd+bwd", lambda: mx.vjp(sdpa, [q, k, v], [mx.ones_like(q)])[1])
def manual(q, k, v):
    kk = mx.repeat(k, 3, axis=1); vv = mx.repeat(v, 3, axis=1)
    s = (q * 0.125) @ kk.swapaxes(-1, -2)
    m = mx.triu(mx.full((L, L), -mx.inf, dtype=mx.bfloat16), k=1)
    p = mx.softmax(s + m, axis=-1, precise=True)
    return p @ vv
tm("manual fwd", lambda: manual(q, k, v))
tm("manual fwd+bwd", lambda: mx.vjp(manual, [q, k, v], [mx.ones_like(q)])[1])
x = mx.random.normal((B, L, 576)).astype(mx.bfloat16); mx.eval(x)
mlp = [nn.Linear(576, 1536, bias=False), nn.Linear(576, 1536, bias=False), nn.Linear(1536, 576, bias=False)]
for l in mlp: l.set_dtype(mx.bfloat16)
def mlpf(x): return mlp[2](nn.silu(mlp[0](x)) * mlp[1](x))
tm("mlp fwd", lambda: mlpf(x))
tm("mlp fwd+bwd (x grad)", lambda: mx.vjp(mlpf, [x], [mx.ones_like(x)])[1])
w = mx.ones((576,), mx.bfloat16)
tm("rms fwd+bwd", lambda: mx.vjp(lambda x, w: mx.fast.rms_norm(x, w, 1e-5), [x, w], [mx.ones_like(x)])[1])
rope = lambda a: mx.fast.rope(a, 64, traditional=False, base=100000.0, scale=1.0, offset=0)
tm("rope fwd+bwd", lambda: mx.vjp(rope, [q], [mx.ones_like(q)])[1])
