"""Session 23 probe: the fused decode attention kernel with each (row, head)'s cache slots split across SPLIT
warps of one block (merged through shared memory) and NB batches of 4 slots per loop trip, against the shipped
kernel: outputs compared, and 30-call chains timed (one per layer, as a decode step calls it) at 64 / 256 /
1,024 rows and three cache lengths. The CUPTI trace of a rollout (busyprobe.py) put the shipped kernel at
~51% of the GPU's time: one warp per (row, head), one wave of 17 warps per SM, ~2 us per 8-slot trip.
Usage (src/ on PYTHONPATH): python attnsplit.py"""
import statistics
import time

import mlx.core as mx
from mlx_grpo.models import decode_attention as A

LOOP = """
    const bool aligned = ((reinterpret_cast<size_t>(kbase) | reinterpret_cast<size_t>(vbase)) & 15) == 0;
    auto load = [&](const T* from, float* to) {
        #pragma unroll
        for (int c = 0; c < PER / VEC; ++c) {
            const T* src = from + (c * G + sub) * VEC;
            if (aligned) {
                const uint4 raw = *reinterpret_cast<const uint4*>(src);
                const T* vals = reinterpret_cast<const T*>(&raw);
                #pragma unroll
                for (int e = 0; e < VEC; ++e) to[c * VEC + e] = static_cast<float>(vals[e]);
            } else {
                #pragma unroll
                for (int e = 0; e < VEC; ++e) to[c * VEC + e] = static_cast<float>(src[e]);
            }
        }
    };
    float m = -INFINITY, denom = 0.0f;
    auto absorb = [&](float dot, const float* v) {
        const float new_m = fmaxf(m, dot);
        const float correction = __expf(m - new_m);
        const float p = __expf(dot - new_m);
        denom = denom * correction + p;
        #pragma unroll
        for (int i = 0; i < PER; ++i) acc[i] = acc[i] * correction + p * v[i];
        m = new_m;
    };
    for (int base = lo; base < hi; base += NB * P) {
        float kk[NB][PER], vv[NB][PER];
        bool valid[NB];
        #pragma unroll
        for (int b = 0; b < NB; ++b) {
            const int s = base + b * P + slot;
            valid[b] = s < hi;
            load(kbase + (size_t)(valid[b] ? s : hi - 1) * D, kk[b]);
            load(vbase + (size_t)(valid[b] ? s : hi - 1) * D, vv[b]);
        }
        float dot[NB];
        #pragma unroll
        for (int b = 0; b < NB; ++b) {
            dot[b] = 0.0f;
            #pragma unroll
            for (int i = 0; i < PER; ++i) dot[b] += q[i] * kk[b][i];
        }
        #pragma unroll
        for (int off = 1; off < G; off <<= 1) {
            #pragma unroll
            for (int b = 0; b < NB; ++b) dot[b] += __shfl_xor_sync(0xffffffff, dot[b], off);
        }
        #pragma unroll
        for (int b = 0; b < NB; ++b) if (valid[b]) absorb(dot[b], vv[b]);
    }
"""

SOURCE = A._LAYOUT + """
    constexpr int HALF = D / 2;
    const int gwarp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32, wib = threadIdx.x / 32;
    const int ROWS = sizes[0], S = sizes[1];
    const bool active = gwarp / SPLIT < ROWS * HQ;
    const int warp = active ? gwarp / SPLIT : 0, part = gwarp % SPLIT;
    const int sub = lane % G, slot = lane / G;
    const int row = warp / HQ, head = warp % HQ;
    const int kv_head = head / (HQ / HKV);
    const T* token = qkv + (size_t)row * (HQ + 2 * HKV) * D;
    const float position = static_cast<float>(pos[row]);
    const float sc = scale[0];
    float q[PER], k_new[PER], v_new[PER], acc[PER];
    #pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int j = ELEMENT(i);
        const int pair = j < HALF ? j + HALF : j - HALF;
        const float sign = j < HALF ? -1.0f : 1.0f;
        float s, c;
        sincosf(position * theta[j < HALF ? j : j - HALF], &s, &c);
        const float qr = static_cast<float>(static_cast<T>(
            static_cast<float>(token[head * D + j]) * c + sign * static_cast<float>(token[head * D + pair]) * s));
        const float kr = static_cast<float>(static_cast<T>(
            static_cast<float>(token[(HQ + kv_head) * D + j]) * c
            + sign * static_cast<float>(token[(HQ + kv_head) * D + pair]) * s));
        q[i] = qr * sc;
        k_new[i] = kr;
        v_new[i] = static_cast<float>(token[(HQ + HKV + kv_head) * D + j]);
        acc[i] = 0.0f;
    }
    const T* kbase = keys + ((size_t)((layer[0] * ROWS + row) * HKV + kv_head) * S) * D;
    const T* vbase = values + ((size_t)((layer[0] * ROWS + row) * HKV + kv_head) * S) * D;
    const int first = start[row], end = stop[0];
    const int span = end > first ? end - first : 0;
    const int chunk = ((span + SPLIT - 1) / SPLIT + NB * P - 1) / (NB * P) * (NB * P);
    const int lo = active ? min(first + part * chunk, end) : 0;
    const int hi = active ? min(lo + chunk, end) : 0;
""" + LOOP + """
    if (active && part == SPLIT - 1) {  // the token's own slot
        float dot = 0.0f;
        #pragma unroll
        for (int i = 0; i < PER; ++i) dot += q[i] * k_new[i];
        #pragma unroll
        for (int off = 1; off < G; off <<= 1) dot += __shfl_xor_sync(0xffffffff, dot, off);
        if (slot == 0) absorb(dot, v_new);
    }
    __shared__ float s_m[8], s_d[8], s_acc[8][D];
    float global_m = m;
    #pragma unroll
    for (int off = G; off < 32; off <<= 1) global_m = fmaxf(global_m, __shfl_xor_sync(0xffffffff, global_m, off));
    const float own = (m == -INFINITY) ? 0.0f : __expf(m - global_m);
    denom *= own;
    #pragma unroll
    for (int off = G; off < 32; off <<= 1) denom += __shfl_xor_sync(0xffffffff, denom, off);
    #pragma unroll
    for (int i = 0; i < PER; ++i) {
        float a = acc[i] * own;
        #pragma unroll
        for (int off = G; off < 32; off <<= 1) a += __shfl_xor_sync(0xffffffff, a, off);
        if (slot == 0) s_acc[wib][ELEMENT(i)] = a;
    }
    if (lane == 0) { s_m[wib] = global_m; s_d[wib] = denom; }
    __syncthreads();
    if (active && part == 0) {
        float M = -INFINITY;
        #pragma unroll
        for (int p = 0; p < SPLIT; ++p) M = fmaxf(M, s_m[wib + p]);
        float w[SPLIT], den = 0.0f;
        #pragma unroll
        for (int p = 0; p < SPLIT; ++p) {
            w[p] = s_m[wib + p] == -INFINITY ? 0.0f : __expf(s_m[wib + p] - M);
            den += s_d[wib + p] * w[p];
        }
        for (int j = lane; j < D; j += 32) {
            float a = 0.0f;
            #pragma unroll
            for (int p = 0; p < SPLIT; ++p) a += s_acc[wib + p][j] * w[p];
            out[(size_t)warp * D + j] = static_cast<T>(a / den);
        }
        if (slot == 0 && head % (HQ / HKV) == 0) {
            #pragma unroll
            for (int i = 0; i < PER; ++i) {
                const size_t at = (size_t)(row * HKV + kv_head) * D + ELEMENT(i);
                new_keys[at] = static_cast<T>(k_new[i]);
                new_values[at] = static_cast<T>(v_new[i]);
            }
        }
    }
"""

KERNEL = mx.fast.cuda_kernel(name="probe_split_fused_decode_attention",
                             input_names=["qkv", "keys", "values", "start", "stop", "pos", "theta", "scale", "sizes",
                                          "layer"],
                             output_names=["out", "new_keys", "new_values"], source=SOURCE)


def split_attention(qkv, keys, values, start, stop, positions, theta, scale, heads, layer, split, nb):
    N = qkv.shape[0]
    _, _, Hkv, S, D = keys.shape
    warps = N * heads * split
    threads = -(-warps // 8) * 256
    return KERNEL(inputs=[qkv, keys, values, start, stop, positions, theta, mx.array([scale], dtype=mx.float32),
                          mx.array([N, S], dtype=mx.int32), mx.array([layer], dtype=mx.int32)],
                  template=[("T", qkv.dtype), ("D", D), ("HQ", heads), ("HKV", Hkv), ("SPLIT", split), ("NB", nb)],
                  grid=(threads, 1, 1), threadgroup=(256, 1, 1),
                  output_shapes=[(N, heads, 1, D), (N, Hkv, 1, D), (N, Hkv, 1, D)], output_dtypes=[qkv.dtype] * 3)


def main():
    Hq, Hkv, D, L, S = 9, 3, 64, 30, 448
    scale = D ** -0.5
    theta = (10000.0 ** (-mx.arange(0, D, 2) / D)).astype(mx.float32)
    variants = [("shipped", None, None)] + [(f"split{s}-nb{b}", s, b) for b in (2, 4) for s in (1, 2, 4, 8)]
    for N in (256, 64, 1024):
        mx.random.seed(0)
        keys = mx.random.normal((L, N, Hkv, S, D)).astype(mx.bfloat16)
        values = mx.random.normal((L, N, Hkv, S, D)).astype(mx.bfloat16)
        qkv = mx.random.normal((N, (Hq + 2 * Hkv) * D)).astype(mx.bfloat16)
        start = mx.random.randint(0, 90, (N,)).astype(mx.int32)
        positions = mx.random.randint(150, 400, (N,)).astype(mx.int32)
        mx.eval(keys, values, qkv, start, positions)
        for stop_n in (170, 300, 420):
            stop = mx.array([stop_n], dtype=mx.int32)

            def call(name, split, nb, layer):
                if split is None:
                    return A.fused_decode_attention(qkv, keys, values, start, stop, positions, theta, scale, Hq, layer)
                return split_attention(qkv, keys, values, start, stop, positions, theta, scale, Hq, layer, split, nb)

            ref = call("shipped", None, None, 3)
            mx.eval(ref)
            line = []
            for name, split, nb in variants:
                got = call(name, split, nb, 3)
                err = max(mx.abs(g.astype(mx.float32) - r.astype(mx.float32)).max().item() for g, r in zip(got, ref))
                times = []
                for rep in range(9):
                    mx.synchronize()
                    t0 = time.perf_counter()
                    outs = [call(name, split, nb, layer)[0] for layer in range(L)]
                    mx.eval(outs)
                    mx.synchronize()
                    times.append(time.perf_counter() - t0)
                med = statistics.median(times[2:]) * 1e3
                line.append(f"{name} {med:.3f} ms (err {err:.1e})")
            print(f"N={N} stop={stop_n}: " + "; ".join(line), flush=True)


if __name__ == "__main__":
    main()
