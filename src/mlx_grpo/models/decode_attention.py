"""Decode-step attention over left-padded rows without a mask array, for NVIDIA GPUs.

A batch of prompts of different lengths is left-padded, so each row must ignore its first
`left_padding[r]` cache slots. mlx-lm expresses that as a boolean mask, and MLX 0.32's CUDA backend
has no fused decode kernel that takes a mask array: it falls back to ~6 unfused ops per layer on a
copied slice of the cache. This module supplies that missing kernel (one warp per row and query head,
online softmax over slots [left_padding[r], stop), 16-byte loads) and routes mlx-lm's attention call to it while a
rollout decodes on our StaticBatchCache; every other call goes to mlx-lm's own function unchanged. The rollout
engine's copy (models/decoder.py) calls the fused kernel instead: RoPE, the cached slots split across up to 4
warps per (row, head), and the token's own slot, in one launch per layer.
"""

from __future__ import annotations

import contextlib
import sys
from functools import lru_cache

import mlx.core as mx

HEAD_DIMS = (64, 128)  # a lane's D / 8 values must be whole 16-byte loads; D = 64 is the one run on a GPU
# Model families whose every layer attends through mlx-lm's module-level scaled_dot_product_attention
# (others, e.g. block-sparse phi3small, compute attention themselves and must not get a maskless cache).
KERNEL_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}

# The pieces every kernel shares. A lane holds PER of a slot's D values: chunk c of 16 bytes (VEC values) at
# element (c * G + sub) * VEC, so one load instruction reads G * 16 contiguous bytes of each of P slots (whole
# 128-byte lines) instead of 2-byte values 32 bytes apart, which cost ~8x the L1 traffic.
_LAYOUT = """
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
_SLOT_LOOP = """
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
_MERGE_GROUPS = """
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

_SOURCE = _LAYOUT + """
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
""" + _SLOT_LOOP + _MERGE_GROUPS.replace("MERGED_STORE", _STORE_OUT)


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
_ONE_LAYER, _LAYER_OF_STACK = "0", "layer[0] * ROWS"


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
                               .replace("LAYER_BASE", _LAYER_OF_STACK))


def kernel_available() -> bool:
    """The kernel runs on MLX's CUDA backend only (Metal's own decode kernel already takes masks)."""
    return hasattr(mx, "cuda") and mx.cuda.is_available() and mx.default_device() == mx.gpu


def kernel_serves(model, head_dim: int) -> bool:
    """The kernel can replace this model's decode attention."""
    return kernel_available() and getattr(model, "model_type", None) in KERNEL_MODEL_TYPES and head_dim in HEAD_DIMS


@lru_cache(maxsize=8)
def _scale_array(scale: float) -> mx.array:
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
        inputs=[queries, keys, values, start, stop, _scale_array(float(scale)), sizes],
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
        inputs=[queries, keys, values, start, stop, _scale_array(float(scale)), mx.array([N, S], dtype=mx.int32),
                mx.array([layer], dtype=mx.int32)],
        template=[("T", queries.dtype), ("D", D), ("HQ", Hq), ("HKV", Hkv), ("NB", 2)],
        grid=(N * Hq * 32, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[queries.shape, (N, Hq, 1)], output_dtypes=[queries.dtype, mx.float32])
    return out, lse


@contextlib.contextmanager
def route_attention(model, cache_type: type):
    """While active, mlx-lm attention calls that pass a `cache_type` cache with `.attend` go to it.

    mlx-lm's attention modules call the module-level `scaled_dot_product_attention(q, k, v, cache=...,
    scale=..., mask=...)`, which dispatches on the cache only for quantized caches; this swaps that
    name in the model's attention module for the duration of the rollout and restores it after."""
    layer = model.layers[0]
    attention = getattr(layer, "self_attn", None)
    module = sys.modules.get(type(attention).__module__) if attention is not None else None
    original = getattr(module, "scaled_dot_product_attention", None)
    if original is None:
        yield False
        return

    def dispatch(queries, keys, values, cache, scale, mask, **kwargs):
        if isinstance(cache, cache_type) and kwargs.get("sinks") is None:
            return cache.attend(queries, keys, values, scale, mask)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)

    module.scaled_dot_product_attention = dispatch
    try:
        yield True
    finally:
        module.scaled_dot_product_attention = original


# The decode step's whole attention for one layer of the rollout engine's copy (models/decoder.py), in one
# launch: RoPE on the token's query and key (rotate-half layout, angles pos * theta), attention over the
# cache slots [start, stop) plus the token's own slot, and the token's key/value for the cache write.
# It replaces ~8 launches per layer (split copies, two RoPEs, attention, the own-slot merge).
# Each (row, head)'s slots are split across SPLIT warps of one 8-warp block, merged through shared memory
# (flash-decoding's split): one warp per (row, head) ran as a single wave of ~17 warps per SM on an H100 at
# 256 rows, each warp walking its whole row; a CUPTI trace put that kernel at half a rollout's GPU time.
_FUSED_SOURCE = _LAYOUT + """
    constexpr int HALF = D / 2;
    const int gwarp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32, wib = threadIdx.x / 32;  // warp in block
    const int ROWS = sizes[0], S = sizes[1];
    // no early return: every warp of a block reaches the barrier; warps past the rows read row 0 and write no
    // output (only their own shared-memory slot, which nobody reads)
    static_assert(8 % SPLIT == 0, "a (row, head)'s SPLIT warps must sit in one 8-warp block");
    const bool active = gwarp / SPLIT < ROWS * HQ;
    const int warp = active ? gwarp / SPLIT : 0, part = gwarp % SPLIT;
    const int sub = lane % G, slot = lane / G;
    const int row = warp / HQ, head = warp % HQ;
    const int kv_head = head / (HQ / HKV);
    const T* token = qkv + (size_t)row * (HQ + 2 * HKV) * D;  // [q heads | k heads | v heads]
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
        // rounded to T as the graph's RoPE output is, so the cache holds what the training forward computes
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
    const T* kbase = keys + ((size_t)((LAYER_BASE + row) * HKV + kv_head) * S) * D;
    const T* vbase = values + ((size_t)((LAYER_BASE + row) * HKV + kv_head) * S) * D;
    // this warp's share of the slots: whole trips of NB * P slots each
    const int first = start[row], end = stop[0];
    const int span = end > first ? end - first : 0;
    const int chunk = ((span + SPLIT - 1) / SPLIT + NB * P - 1) / (NB * P) * (NB * P);
    const int lo = active ? min(first + part * chunk, end) : 0;
    const int hi = active ? min(lo + chunk, end) : 0;
""" + _SLOT_LOOP + """
    if (active && part == SPLIT - 1) {  // the token's own slot, taken by slot group 0 of the last part
        float dot = 0.0f;
        #pragma unroll
        for (int i = 0; i < PER; ++i) dot += q[i] * k_new[i];
        #pragma unroll
        for (int off = 1; off < G; off <<= 1) dot += __shfl_xor_sync(0xffffffff, dot, off);
        if (slot == 0) absorb(dot, v_new);
    }
    // each warp's slot groups merged, then (below) the block's SPLIT parts of each (row, head)
    __shared__ float part_m[8], part_denom[8], part_acc[8][D];
""" + _MERGE_GROUPS.replace("MERGED_STORE", "part_acc[wib][ELEMENT(i)] = a") + """
    if (lane == 0) {
        part_m[wib] = global_m;
        part_denom[wib] = denom;
    }
    __syncthreads();
    if (active && part == 0) {  // the first part's warp writes; its block holds the others at wib + 1 ..
        float top = -INFINITY, weight[SPLIT], total = 0.0f;
        #pragma unroll
        for (int p = 0; p < SPLIT; ++p) top = fmaxf(top, part_m[wib + p]);
        #pragma unroll
        for (int p = 0; p < SPLIT; ++p) {  // a part that saw no slot weighs 0 (the last always has the own slot)
            weight[p] = part_m[wib + p] == -INFINITY ? 0.0f : __expf(part_m[wib + p] - top);
            total += part_denom[wib + p] * weight[p];
        }
        for (int j = lane; j < D; j += 32) {
            float a = 0.0f;
            #pragma unroll
            for (int p = 0; p < SPLIT; ++p) a += part_acc[wib + p][j] * weight[p];
            out[(size_t)warp * D + j] = static_cast<T>(a / total);
        }
        if (slot == 0 && head % (HQ / HKV) == 0) {  // one warp per kv head writes the token's key and value
            #pragma unroll
            for (int i = 0; i < PER; ++i) {
                const size_t at = (size_t)(row * HKV + kv_head) * D + ELEMENT(i);
                new_keys[at] = static_cast<T>(k_new[i]);
                new_values[at] = static_cast<T>(v_new[i]);
            }
        }
    }
"""


@lru_cache(maxsize=1)
def _fused_kernel():
    return mx.fast.cuda_kernel(name="mlx_grpo_fused_decode_attention",
                               input_names=["qkv", "keys", "values", "start", "stop", "pos", "theta", "scale",
                                            "sizes", "layer"],
                               output_names=["out", "new_keys", "new_values"],
                               source=_FUSED_SOURCE.replace("LAYER_BASE", _LAYER_OF_STACK))


def fused_split(rows: int, heads: int, head_dim: int) -> tuple[int, int]:
    """(SPLIT warps per (row, head), NB batches per trip) of the fused kernel. Measured on an H100
    (docs/benchmarks-history.md, eleventh sitting; 30-call chains, 170-420 cached slots): at 256 rows x 9 heads, 4 warps
    and 4 batches took 15-20% less time than one warp and 2; at 1,024 rows splitting lost (up to +17%) and
    at 64 it was mixed. 128-wide heads keep 2 batches: 4 would hold 128 floats of keys and values per lane."""
    split = 4 if 1024 <= rows * heads <= 4096 else 1
    return split, (4 if head_dim == 64 else 2)


def fused_decode_attention(qkv: mx.array, keys: mx.array, values: mx.array, start: mx.array, stop: mx.array,
                           positions: mx.array, theta: mx.array, scale: float, heads: int, layer: int):
    """RoPE + attention of each row's new token over cache slots [start[r], stop[0]) of layer `layer` and
    itself. qkv [N, (Hq + 2 Hkv) D] the token's projections (pre-RoPE); keys, values [layers, N, Hkv, S, D];
    positions [N] int32 RoPE positions; theta [D / 2] float32 angles per position. -> (out [N, Hq, 1, D],
    the token's RoPE'd key and its value, each [N, Hkv, 1, D])."""
    N = qkv.shape[0]
    _, _, Hkv, S, D = keys.shape
    assert D in HEAD_DIMS and heads % Hkv == 0 and qkv.shape[1] == (heads + 2 * Hkv) * D
    split, batches = fused_split(N, heads, D)
    blocks = -(-N * heads * split // 8)  # 8 warps a block; a (row, head)'s parts never straddle two
    return _fused_kernel()(
        inputs=[qkv, keys, values, start, stop, positions, theta, _scale_array(float(scale)),
                mx.array([N, S], dtype=mx.int32), mx.array([layer], dtype=mx.int32)],
        template=[("T", qkv.dtype), ("D", D), ("HQ", heads), ("HKV", Hkv), ("SPLIT", split), ("NB", batches)],
        grid=(blocks * 256, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[(N, heads, 1, D), (N, Hkv, 1, D), (N, Hkv, 1, D)],
        output_dtypes=[qkv.dtype] * 3)
