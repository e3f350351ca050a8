"""Decode-step attention over left-padded rows without a mask array, on NVIDIA GPUs, beside its MLX reference.

A batch of prompts of different lengths is left-padded, so each row must ignore its first `left_padding[r]`
cache slots. mlx-lm expresses that as a boolean mask, and MLX 0.32's CUDA backend has no fused decode kernel
that takes a mask array: it falls back to ~6 unfused ops per layer on a copied slice of the cache. The kernels
here are that missing fused kernel (one warp per row and query head, online softmax over slots
[left_padding[r], stop), 16-byte loads):

  left_padded_attention      the model path's decode attention (rollout/decode.StaticBatchCache.attend)
  left_padded_attention_lse  the same over one layer of a stacked cache, plus each (row, head)'s log-sum-exp,
                             so the engine's copy (models/decoder.py) can merge in the token's own slot

each with its reference (`..._reference`: masked attention in float32, plain MLX). This module also holds the
CUDA source pieces that kernels/fused_attention.py shares (LAYOUT, SLOT_LOOP, MERGE_GROUPS).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

HEAD_DIMS = (64, 128)  # a lane's D / 8 values must be whole 16-byte loads; D = 64 is the one run on a GPU

# The pieces every kernel shares. A lane holds PER of a slot's D values: chunk c of 16 bytes (VEC values) at
# element (c * G + sub) * VEC, so one load instruction reads G * 16 contiguous bytes of each of P slots (whole
# 128-byte lines) instead of 2-byte values 32 bytes apart, which cost ~8x the L1 traffic.
LAYOUT = """
    constexpr int VEC = 16 / sizeof(T);  // values per 16-byte load
    constexpr int G = 8;                 // lanes per slot
    constexpr int P = 32 / G;            // slots per batch
    constexpr int PER = D / G;           // values per lane per slot
    static_assert(PER % VEC == 0, "a lane's values must be whole 16-byte chunks");
    #define ELEMENT(i) ((((i) / VEC) * G + sub) * VEC + (i) % VEC)
"""
# The online softmax over cache slots [lo, hi) by groups of G lanes, NB batches of P slots per trip with all
# their loads issued first (a lane past the end reads the last slot and drops it), so a warp waits on memory
# about once per NB * P slots. `aligned` falls back to per-value loads for a base not on 16 bytes.
SLOT_LOOP = """
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
    auto absorb = [&](float dot, const float* v) {  // one slot into the online softmax (running max m)
        const float new_m = fmaxf(m, dot);
        const float correction = __expf(m - new_m);
        const float p = __expf(dot - new_m);
        denom = denom * correction + p;
        #pragma unroll
        for (int i = 0; i < PER; ++i) acc[i] = acc[i] * correction + p * v[i];
        m = new_m;
    };
    for (int base = lo; base < hi; base += NB * P) {  // uniform trip count: shuffles need every lane
        float kk[NB][PER], vv[NB][PER], dot[NB];
        bool valid[NB];
        #pragma unroll
        for (int b = 0; b < NB; ++b) {
            const int s = base + b * P + slot;
            valid[b] = s < hi;
            load(kbase + (size_t)(valid[b] ? s : hi - 1) * D, kk[b]);
            load(vbase + (size_t)(valid[b] ? s : hi - 1) * D, vv[b]);
        }
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
# The merge of a warp's slot groups' softmaxes (global_m, denom, and each value `a`, summed over the groups);
# MERGED_STORE: what a lane of slot group 0 does with `a`.
MERGE_GROUPS = """
    float global_m = m;
    #pragma unroll
    for (int off = G; off < 32; off <<= 1) global_m = fmaxf(global_m, __shfl_xor_sync(0xffffffff, global_m, off));
    const float own = (m == -INFINITY) ? 0.0f : __expf(m - global_m);  // slot groups that saw no slot add 0
    denom *= own;
    #pragma unroll
    for (int off = G; off < 32; off <<= 1) denom += __shfl_xor_sync(0xffffffff, denom, off);
    #pragma unroll
    for (int i = 0; i < PER; ++i) {
        float a = acc[i] * own;
        #pragma unroll
        for (int off = G; off < 32; off <<= 1) a += __shfl_xor_sync(0xffffffff, a, off);
        if (slot == 0) MERGED_STORE;
    }
"""
# The plain and lse kernels' store (OUT_VALUE: what a lane writes).
_STORE_OUT = "out[(size_t)warp * D + ELEMENT(i)] = static_cast<T>(OUT_VALUE)"

_SOURCE = LAYOUT + """
    // One warp per (row, query head). The warp takes P slots per batch; the G lanes of a slot split its head
    // dims, reduce the dot product with log2(G) shuffles and run an online softmax. The slot groups'
    // softmaxes are merged at the end. Registers: ~6 x PER floats per lane.
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    const int ROWS = sizes[0], S = sizes[1];  // run-time: a new capacity must not mean a new compile
    if (warp >= ROWS * HQ) return;
    const int sub = lane % G, slot = lane / G;
    const int row = warp / HQ;
    const int kv_head = (warp % HQ) / (HQ / HKV);
    const T* kbase = keys + ((size_t)((LAYER_BASE + row) * HKV + kv_head) * S) * D;
    const T* vbase = values + ((size_t)((LAYER_BASE + row) * HKV + kv_head) * S) * D;
    const float sc = scale[0];
    const int lo = start[row], hi = stop[0];
    float q[PER], acc[PER];
    #pragma unroll
    for (int i = 0; i < PER; ++i) {
        q[i] = static_cast<float>(queries[(size_t)warp * D + ELEMENT(i)]) * sc;
        acc[i] = 0.0f;
    }
""" + SLOT_LOOP + MERGE_GROUPS.replace("MERGED_STORE", _STORE_OUT)


_OUT_PLAIN = "a / denom"
# With the log-sum-exp output a row may see no slot at all (its caller adds the token's own slot):
# out is then 0 and lse -inf, which the caller's merge weighs by exp(-inf) = 0.
_OUT_LSE = "(denom > 0.0f ? a / denom : 0.0f)"
_LSE_STORE = """
    if (lane == 0) lse[warp] = denom > 0.0f ? global_m + logf(denom) : -INFINITY;
"""


_INPUTS = ["queries", "keys", "values", "start", "stop", "scale", "sizes"]
# The lse and fused kernels read layer `layer[0]` of one [layers, N, Hkv, S, D] cache for every layer, so a
# decode step writes all layers' new keys with one update (and no per-layer slice view pins the buffer).
_ONE_LAYER, LAYER_OF_STACK = "0", "layer[0] * ROWS"


@lru_cache(maxsize=1)
def _kernel():
    return mx.fast.cuda_kernel(name="mlx_grpo_left_padded_decode_attention", input_names=_INPUTS,
                               output_names=["out"],
                               source=_SOURCE.replace("OUT_VALUE", _OUT_PLAIN).replace("LAYER_BASE", _ONE_LAYER))


@lru_cache(maxsize=1)
def _kernel_lse():
    return mx.fast.cuda_kernel(name="mlx_grpo_left_padded_decode_attention_lse", input_names=_INPUTS + ["layer"],
                               output_names=["out", "lse"],
                               source=(_SOURCE.replace("OUT_VALUE", _OUT_LSE) + _LSE_STORE)
                               .replace("LAYER_BASE", LAYER_OF_STACK))


@lru_cache(maxsize=8)
def scale_array(scale: float) -> mx.array:
    """The score scale as the kernels read it: a float32 [1] array, one per distinct scale."""
    return mx.array([scale], dtype=mx.float32)


def left_padded_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                          start: mx.array, stop: mx.array, sizes: mx.array | None = None) -> mx.array:
    """softmax(q k^T * scale) v over slots [start[r], stop[0]) of each row r.
    queries [N, Hq, 1, D]; keys, values [N, Hkv, S, D]; start [N] int32; stop [1] int32; sizes [2] int32
    = (N, S), passed in so a caller can build it once -> [N, Hq, 1, D]."""
    N, Hq, L, D = queries.shape
    _, Hkv, S, _ = keys.shape
    assert L == 1 and D in HEAD_DIMS and values.shape[-1] == D and Hq % Hkv == 0, \
        f"decode attention: one query, equal key/value head dims in {HEAD_DIMS}"
    threads = N * Hq * 32
    if sizes is None:
        sizes = mx.array([N, S], dtype=mx.int32)
    return _kernel()(
        inputs=[queries, keys, values, start, stop, scale_array(float(scale)), sizes],
        template=[("T", queries.dtype), ("D", D), ("HQ", Hq), ("HKV", Hkv), ("NB", 2)],
        grid=(threads, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[queries.shape], output_dtypes=[queries.dtype])[0]


def left_padded_attention_lse(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                              start: mx.array, stop: mx.array, layer: int) -> tuple[mx.array, mx.array]:
    """left_padded_attention over layer `layer` of keys, values [layers, N, Hkv, S, D], plus each (row,
    head)'s log-sum-exp of the scaled scores, so a caller can merge in slots the cache does not hold yet.
    -> (out [N, Hq, 1, D], lse [N, Hq, 1] float32); a row with no slot in [start, stop) gives out 0, lse -inf."""
    N, Hq, L, D = queries.shape
    _, _, Hkv, S, _ = keys.shape
    assert L == 1 and D in HEAD_DIMS and values.shape[-1] == D and Hq % Hkv == 0, \
        f"decode attention: one query, equal key/value head dims in {HEAD_DIMS}"
    out, lse = _kernel_lse()(
        inputs=[queries, keys, values, start, stop, scale_array(float(scale)), mx.array([N, S], dtype=mx.int32),
                mx.array([layer], dtype=mx.int32)],
        template=[("T", queries.dtype), ("D", D), ("HQ", Hq), ("HKV", Hkv), ("NB", 2)],
        grid=(N * Hq * 32, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[queries.shape, (N, Hq, 1)], output_dtypes=[queries.dtype, mx.float32])
    return out, lse




def _slots_mask(start: mx.array, stop: mx.array, slots: int) -> mx.array:
    """[N, 1, 1, slots] bool: slot s of row r is attended when start[r] <= s < stop[0]."""
    positions = mx.arange(slots)
    return ((positions[None] >= start[:, None]) & (positions[None] < stop[0]))[:, None, None, :]


def left_padded_attention_reference(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                                    start: mx.array, stop: mx.array, sizes: mx.array | None = None) -> mx.array:
    """What left_padded_attention computes, in plain MLX: masked attention over slots [start[r], stop[0]) of
    row r, in float32 from the inputs as given. -> [N, Hq, 1, D] float32."""
    f32 = mx.float32
    return mx.fast.scaled_dot_product_attention(queries.astype(f32), keys.astype(f32), values.astype(f32),
                                                scale=scale, mask=_slots_mask(start, stop, keys.shape[2]))


def left_padded_attention_lse_reference(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                                        start: mx.array, stop: mx.array, layer: int) -> tuple[mx.array, mx.array]:
    """What left_padded_attention_lse computes, in plain MLX and float32: (out [N, Hq, 1, D], lse [N, Hq, 1]);
    a row with no slot in [start, stop) gives out 0, lse -inf."""
    f32 = mx.float32
    k, v = keys[layer].astype(f32), values[layer].astype(f32)  # [N, Hkv, S, D]
    mask = _slots_mask(start, stop, k.shape[2])
    repeats = queries.shape[1] // k.shape[1]
    scores = (queries.astype(f32) * scale) @ mx.repeat(k, repeats, axis=1).transpose(0, 1, 3, 2)  # [N, Hq, 1, S]
    lse = mx.logsumexp(mx.where(mask, scores, -mx.inf), axis=-1)  # [N, Hq, 1]
    out = mx.fast.scaled_dot_product_attention(queries.astype(f32), k, v, scale=scale, mask=mask)
    return mx.where(mx.isfinite(lse)[..., None], out, 0.0), lse
