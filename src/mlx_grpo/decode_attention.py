"""Decode-step attention over left-padded rows without a mask array, for NVIDIA GPUs.

A batch of prompts of different lengths is left-padded, so each row must ignore its first
`left_padding[r]` cache slots. mlx-lm expresses that as a boolean mask, and MLX 0.32's CUDA backend
has no fused decode kernel that takes a mask array: it falls back to ~6 unfused ops per layer on a
copied slice of the cache. This module supplies that missing kernel (one warp per row and query head,
online softmax over slots [left_padding[r], stop) split across lanes) and routes mlx-lm's attention call to it while a
rollout decodes on our StaticBatchCache; every other call goes to mlx-lm's own function unchanged.
"""

from __future__ import annotations

import contextlib
import sys
from functools import lru_cache

import mlx.core as mx

MAX_HEAD_DIM = 128  # q and the accumulator live in registers: 2 * D floats per lane

_SOURCE = """
    // One warp per (row, query head). Lane l takes slots first+l, first+l+32, ... with a full-width
    // dot product and its own online softmax; the 32 partial softmaxes are merged at the end. Spreading
    // slots (not head dims) over lanes keeps ~S/32 dependent iterations per warp, so small batches
    // are not latency-bound.
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (warp >= ROWS * HQ) return;
    const int row = warp / HQ;
    const int kv_head = (warp % HQ) / (HQ / HKV);
    const T* kbase = keys + ((size_t)(row * HKV + kv_head) * S) * D;
    const T* vbase = values + ((size_t)(row * HKV + kv_head) * S) * D;
    const float sc = scale[0];
    float q[D], acc[D];
    #pragma unroll
    for (int d = 0; d < D; ++d) {
        q[d] = static_cast<float>(queries[(size_t)warp * D + d]) * sc;
        acc[d] = 0.0f;
    }
    float m = -INFINITY, denom = 0.0f;
    const int last = stop[0];
    for (int s = start[row] + lane; s < last; s += 32) {
        const T* kr = kbase + (size_t)s * D;
        const T* vr = vbase + (size_t)s * D;
        float dot = 0.0f;
        #pragma unroll
        for (int d = 0; d < D; ++d) dot += q[d] * static_cast<float>(kr[d]);
        const float new_m = fmaxf(m, dot);
        const float correction = __expf(m - new_m);
        const float p = __expf(dot - new_m);
        denom = denom * correction + p;
        #pragma unroll
        for (int d = 0; d < D; ++d) acc[d] = acc[d] * correction + p * static_cast<float>(vr[d]);
        m = new_m;
    }
    float global_m = m;
    for (int off = 16; off > 0; off >>= 1) global_m = fmaxf(global_m, __shfl_xor_sync(0xffffffff, global_m, off));
    const float own = (m == -INFINITY) ? 0.0f : __expf(m - global_m);  // lanes that saw no slot add 0
    denom *= own;
    for (int off = 16; off > 0; off >>= 1) denom += __shfl_xor_sync(0xffffffff, denom, off);
    #pragma unroll
    for (int d = 0; d < D; ++d) {
        float a = acc[d] * own;
        for (int off = 16; off > 0; off >>= 1) a += __shfl_xor_sync(0xffffffff, a, off);
        if (d % 32 == lane) out[(size_t)warp * D + d] = static_cast<T>(a / denom);
    }
"""


@lru_cache(maxsize=1)
def _kernel():
    return mx.fast.cuda_kernel(name="mlx_grpo_left_padded_decode_attention",
                               input_names=["queries", "keys", "values", "start", "stop", "scale"],
                               output_names=["out"], source=_SOURCE)


def kernel_available() -> bool:
    """The kernel runs on MLX's CUDA backend only (Metal's own decode kernel already takes masks)."""
    return hasattr(mx, "cuda") and mx.cuda.is_available() and mx.default_device() == mx.gpu


@lru_cache(maxsize=8)
def _scale_array(scale: float) -> mx.array:
    return mx.array([scale], dtype=mx.float32)


def left_padded_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                          start: mx.array, stop: mx.array) -> mx.array:
    """softmax(q k^T * scale) v over slots [start[r], stop[0]) of each row r.
    queries [N, Hq, 1, D]; keys, values [N, Hkv, S, D]; start [N] int32; stop [1] int32 -> [N, Hq, 1, D]."""
    N, Hq, L, D = queries.shape
    _, Hkv, S, _ = keys.shape
    assert L == 1 and D <= MAX_HEAD_DIM and Hq % Hkv == 0, "decode attention: one query, head dim <= 128"
    threads = N * Hq * 32
    return _kernel()(
        inputs=[queries, keys, values, start, stop, _scale_array(float(scale))],
        template=[("T", queries.dtype), ("D", D), ("HQ", Hq), ("HKV", Hkv), ("S", S), ("ROWS", N)],
        grid=(threads, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[queries.shape], output_dtypes=[queries.dtype])[0]


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
        if isinstance(cache, cache_type) and not kwargs.get("sinks"):
            return cache.attend(queries, keys, values, scale, mask)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)

    module.scaled_dot_product_attention = dispatch
    try:
        yield True
    finally:
        module.scaled_dot_product_attention = original
