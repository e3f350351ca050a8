"""One output-head chunk, [8192 x 576] x [49152 x 576] bf16: the matmul and each float32 step after it (ms, mean
of 5 after one warm-up)."""
import time, mlx.core as mx
from mlx_grpo.models.forward import token_logprobs
M, D, V = 8192, 576, 49152
h = mx.random.normal((M, D)).astype(mx.bfloat16); w = mx.random.normal((V, D)).astype(mx.bfloat16) * 0.05
t = mx.random.randint(0, V, (M,))
def tm(name, fn, n=5):
    mx.eval(fn()); mx.synchronize(); t0 = time.perf_counter()
    for _ in range(n): mx.eval(fn())
    mx.synchronize(); print(f"{name}: {(time.perf_counter()-t0)/n*1e3:.2f} ms", flush=True)
tm("matmul bf16", lambda: h @ w.T)
tm("matmul+f32", lambda: (h @ w.T).astype(mx.float32))
tm("logsumexp f32", lambda: mx.logsumexp((h @ w.T).astype(mx.float32), axis=-1))
tm("logsumexp bf16", lambda: mx.logsumexp(h @ w.T, axis=-1))
tm("max f32", lambda: mx.max((h @ w.T).astype(mx.float32), axis=-1))
tm("sum f32", lambda: mx.sum((h @ w.T).astype(mx.float32), axis=-1))
tm("softmax f32", lambda: mx.softmax((h @ w.T).astype(mx.float32), axis=-1))
tm("take_along", lambda: mx.take_along_axis((h @ w.T).astype(mx.float32), t[:, None], axis=-1))
tm("token_logprobs", lambda: token_logprobs(h @ w.T, t, 1.0))
tm("compiled token_logprobs", mx.compile(lambda: token_logprobs(h @ w.T, t, 1.0)))
