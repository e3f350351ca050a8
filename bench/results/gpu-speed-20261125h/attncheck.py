"""Session 20, GPU: the fused decode attention with 16-byte loads (src/) against the kernel as shipped before
(git 976525f, previous.py) and a float64 numpy reference; unaligned input; standalone kernel timing; the keyed
sampler's tokens against MLX's vmapped categorical and its time."""
import sys, time
import numpy as np
import mlx.core as mx
sys.path.insert(0, "bench")
from mlx_grpo.models import decode_attention as new
sys.path.insert(0, "bench/results/gpu-speed-20261125h")
from previous import previous_attention
old = previous_attention()

HQ, HKV = 9, 3

def to_np(a):
    return np.array(a.astype(mx.float32), dtype=np.float64)

def reference(qkv, keys, values, start, stop, pos, theta, scale, layer, dtype, D):
    """float64: RoPE (rotate half) on q and k, rounded to dtype as the kernel does; attention over [start, stop) + own."""
    N = qkv.shape[0]
    t = to_np(qkv).reshape(N, HQ + 2 * HKV, D)
    ang = np.array(pos)[:, None].astype(np.float64) * np.array(theta, dtype=np.float64)[None]  # [N, D/2]
    c, s = np.cos(ang), np.sin(ang)
    def rope(x):  # [N, H, D]
        a, b = x[..., :D // 2], x[..., D // 2:]
        r = np.concatenate([a * c[:, None] - b * s[:, None], b * c[:, None] + a * s[:, None]], axis=-1)
        return to_np(mx.array(r.astype(np.float32)).astype(dtype))
    q, k, v = rope(t[:, :HQ]), rope(t[:, HQ:HQ + HKV]), t[:, HQ + HKV:]
    K, V = to_np(keys[layer]), to_np(values[layer])
    out = np.zeros((N, HQ, D))
    st = np.array(start); sp = int(stop[0])
    for r in range(N):
        for h in range(HQ):
            kv = h // (HQ // HKV)
            ks = np.concatenate([K[r, kv, st[r]:sp], k[r, kv][None]]); vs = np.concatenate([V[r, kv, st[r]:sp], v[r, kv][None]])
            sc = ks @ q[r, h] * scale
            w = np.exp(sc - sc.max()); w /= w.sum()
            out[r, h] = w @ vs
    return out, k, v

def inputs(N, D, S, stop, dtype, seed, layers=2):
    mx.random.seed(seed)
    qkv = mx.random.normal((N, (HQ + 2 * HKV) * D)).astype(dtype)
    keys = mx.random.normal((layers, N, HKV, S, D)).astype(dtype)
    values = mx.random.normal((layers, N, HKV, S, D)).astype(dtype)
    start = mx.random.randint(0, stop - 20, (N,)).astype(mx.int32)
    start = mx.where(mx.arange(N) == 0, stop, start).astype(mx.int32)  # row 0: only its own slot
    pos = mx.random.randint(0, 4000, (N,)).astype(mx.int32)
    theta = mx.array((1.0 / (100000 ** (np.arange(0, D, 2) / D))).astype(np.float32))
    return qkv, keys, values, start, mx.array([stop], dtype=mx.int32), pos, theta

ok = True
for dtype in (mx.float32, mx.bfloat16):
    for D in (64, 128):
        for N, S, stop in ((8, 300, 211), (33, 64, 64), (5, 40, 23)):
            qkv, keys, values, start, stopa, pos, theta = inputs(N, D, S, stop, dtype, N + D)
            scale = D ** -0.5
            ref, rk, rv = reference(qkv, keys, values, start, stopa, pos, theta, scale, 1, dtype, D)
            res = {}
            for name, mod in (("new", new), ("old", old)):
                out, k, v = mod.fused_decode_attention(qkv, keys, values, start, stopa, pos, theta, scale, HQ, 1)
                res[name] = (to_np(out).reshape(N, HQ, D), to_np(k).reshape(N, HKV, D), to_np(v).reshape(N, HKV, D))
            # unaligned: the cache as a view one value into a flat buffer
            flat = mx.concatenate([mx.zeros((1,), dtype=dtype), keys.reshape(-1)])
            flatv = mx.concatenate([mx.zeros((1,), dtype=dtype), values.reshape(-1)])
            ku, vu = flat[1:].reshape(keys.shape), flatv[1:].reshape(values.shape)
            out, k, v = new.fused_decode_attention(qkv, ku, vu, start, stopa, pos, theta, scale, HQ, 1)
            res["unaligned"] = (to_np(out).reshape(N, HQ, D), to_np(k).reshape(N, HKV, D), to_np(v).reshape(N, HKV, D))
            tol = 1e-4 if dtype == mx.float32 else 3e-2
            line = []
            for name, (o, k, v) in res.items():
                e = np.abs(o - ref).max(); ek = np.abs(k - rk).max(); ev = np.abs(v - rv).max()
                line.append(f"{name} out {e:.1e} k {ek:.1e} v {ev:.1e}")
                ok &= e < tol and ek < tol and ev < tol
            print(f"fused {dtype} D={D} N={N} S={S} stop={stop}: " + "; ".join(line), flush=True)
    # plain and lse kernels against masked attention (rollout_bench's check) and the old kernels
    N, S, stop = 64, 300, 211
    for D in (64, 128):
        mx.random.seed(D)
        q = mx.random.normal((N, HQ, 1, D)).astype(dtype)
        k = mx.random.normal((N, HKV, S, D)).astype(dtype); v = mx.random.normal((N, HKV, S, D)).astype(dtype)
        start = mx.random.randint(0, 150, (N,)).astype(mx.int32); stopa = mx.array([stop], dtype=mx.int32)
        a = new.left_padded_attention(q, k, v, D ** -0.5, start, stopa); b = old.left_padded_attention(q, k, v, D ** -0.5, start, stopa)
        (a2, l2), (b2, m2) = (m.left_padded_attention_lse(q, mx.stack([k, k]), mx.stack([v, v]), D ** -0.5, start, stopa, 1) for m in (new, old))
        e1 = mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
        e2 = mx.abs(a2.astype(mx.float32) - b2.astype(mx.float32)).max().item(); e3 = mx.abs(l2 - m2).max().item()
        print(f"plain/lse {dtype} D={D}: new vs old out {e1:.1e}, lse-kernel out {e2:.1e}, lse {e3:.1e}", flush=True)
        ok &= e1 < (1e-5 if dtype == mx.float32 else 2e-2) and e2 < (1e-5 if dtype == mx.float32 else 2e-2) and e3 < 1e-3
import rollout_bench
rollout_bench.check_attention_kernel()
print("ATTENTION CHECK", "PASSED" if ok else "FAILED", flush=True)

# standalone: 30 layers' fused kernel at ~130 cached slots, old vs new, interleaved
def chain(mod, N, reps=10):
    qkv, keys, values, start, stopa, pos, theta = inputs(N, 64, 400, 150, mx.bfloat16, 7, layers=30)
    start = mx.random.randint(0, 40, (N,)).astype(mx.int32)
    mx.eval(qkv, keys, values, start)
    times = []
    for _ in range(reps):
        mx.synchronize(); t0 = time.perf_counter()
        outs = [mod.fused_decode_attention(qkv, keys, values, start, stopa, pos, theta, 0.125, HQ, l)[0] for l in range(30)]
        mx.eval(outs); times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]
for N in (64, 256, 1024):
    r = {name: [] for name in ("old", "new")}
    for _ in range(2):
        for name, mod in (("old", old), ("new", new)):
            r[name].append(chain(mod, N))
    print(f"30 fused-attention calls, {N} rows, ~110-150 slots: old {r['old']} ms, new {r['new']} ms", flush=True)

# the keyed sampler
from mlx_grpo.rollout.keyed_bits import categorical_from_bits, keyed_bits
mine = mx.compile(lambda f, k: categorical_from_bits(f, keyed_bits(k, f.shape[-1])))
theirs = mx.compile(lambda f, k: mx.vmap(lambda row, key: mx.random.categorical(row, key=key))(f, k))
same_all = True
for n, V in ((256, 49152), (64, 49152), (1024, 49152), (256, 151936), (7, 11), (300, 1000)):
    logits = mx.random.normal((n, V), key=mx.random.key(n)) * (0.05 if V == 1000 else 3)
    filtered = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    keys = mx.random.split(mx.random.key(V), n)
    a, b = theirs(filtered, keys), mine(filtered, keys)
    same = mx.mean(a == b).item(); same_all &= same == 1.0
    times = {}
    for name, fn in (("mlx", theirs), ("keyed", mine), ("mlx2", theirs), ("keyed2", mine)):
        outs = []
        mx.synchronize(); t0 = time.perf_counter()
        for i in range(32):
            outs.append(fn(filtered, keys))
        mx.eval(outs); times[name] = (time.perf_counter() - t0) / 32 * 1e3
    print(f"sampler {n}x{V}: same tokens {same:.4f}; ms per call " + ", ".join(f"{k} {v:.3f}" for k, v in times.items()), flush=True)
print("SAMPLER CHECK", "PASSED" if same_all else "FAILED", flush=True)
