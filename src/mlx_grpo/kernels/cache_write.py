"""Writing admitted rows' key/value blocks into slots of the engine's KV cache in place, on NVIDIA GPUs, beside its
MLX reference (write_rows_reference: a scatter, whose result is a new array wherever MLX cannot donate the cache).

A refill of the decode loop (rollout/loop.py) puts rows that join the batch into the slots of rows that ended.
MLX's scatter would write in place only if nothing else held the cache's buffer, and MLX keeps a kernel's inputs
alive until it ends on the GPU, so right after a sync the scatter may still copy the whole cache. The kernel
writes into the cache's own buffer instead: MLX does not see the write, so it is only for a cache no other array
shares, and no lazily built read of the cache may be pending across it (MLX orders kernels by the buffers they
output, so it would not order such a read before the write): write_rows commits its flag (async_eval, without
waiting for it) before it returns, and the decode loop evaluates every read of the cache (the sync, the turns'
blocks) before a refill, or at least queues it (the turns' blocks with its lookahead): each eval or async_eval ends
by committing what it queued, and the one stream runs that before anything queued later (a read queued after the
write sees it).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

from mlx_grpo.kernels import available

_SOURCE = """
    const size_t L = dims[0], R = dims[1], H = dims[2], S = dims[3], D = dims[4], N = dims[5], W = dims[6];
    const size_t total = L * N * H * W * D;
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (size_t)gridDim.x * blockDim.x) {
        size_t r = e / D;
        const size_t d = e % D, w = r % W;
        r /= W;
        const size_t h = r % H;
        r /= H;
        const size_t i = r % N, l = r / N;
        const size_t to = (((l * R + (size_t)slots[i]) * H + h) * S + (size_t)at[0] + w) * D + d;
        const_cast<T*>(keys)[to] = block_keys[e];
        const_cast<T*>(values)[to] = block_values[e];
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) done[0] = 1;
"""


@lru_cache(maxsize=1)
def _kernel():
    return mx.fast.cuda_kernel(name="mlx_grpo_cache_write_rows",
                               input_names=["keys", "values", "block_keys", "block_values", "slots", "at", "dims"],
                               output_names=["done"], source=_SOURCE)


def write_rows(keys: mx.array, values: mx.array, block_keys: mx.array, block_values: mx.array, slots: np.ndarray,
               at: int) -> tuple[mx.array, mx.array]:
    """keys, values [layers, R, Hkv, S, D] with rows `slots` [n] (integers, on the host), cache slots at .. at + W - 1,
    set to block_keys, block_values [layers, n, Hkv, W, D]. -> the same two arrays, so written: on a CUDA device in
    place by the kernel (queued, not waited for: MLX does not know the arrays change, but everything that reads them
    later is queued behind it on the one stream), elsewhere by write_rows_reference."""
    if not available():
        return write_rows_reference(keys, values, block_keys, block_values, slots, at)
    L, R, H, S, D = keys.shape
    n, W = block_keys.shape[1], block_keys.shape[3]
    # the kernel writes where these say: a wrong shape would write out of bounds, not fail. The slots are checked on
    # the host: a reduction of a device array read back would wait for every decode step queued before it
    assert values.shape == keys.shape and values.dtype == keys.dtype and slots.shape == (n,)
    assert block_keys.shape == block_values.shape == (L, n, H, W, D) and block_keys.dtype == block_values.dtype \
        == keys.dtype and 0 <= at and at + W <= S and int(slots.max()) < R and int(slots.min()) >= 0
    total = L * n * H * W * D
    done = _kernel()(inputs=[keys, values, block_keys, block_values, mx.array(slots, dtype=mx.int32),
                             mx.array([at], dtype=mx.int32), mx.array([L, R, H, S, D, n, W], dtype=mx.int32)],
                     template=[("T", keys.dtype)], grid=(min(-(-total // 256), 8192) * 256, 1, 1),
                     threadgroup=(256, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.int32])[0]
    mx.async_eval(done)  # committed now (nothing reads `done`); the host goes on while the device writes
    return keys, values


def write_rows_reference(keys: mx.array, values: mx.array, block_keys: mx.array, block_values: mx.array,
                         slots: np.ndarray, at: int) -> tuple[mx.array, mx.array]:
    """What write_rows computes, in plain MLX: a scatter (the arrays take its result; in place where MLX donates)."""
    W, slots = block_keys.shape[3], mx.array(slots, dtype=mx.int32)
    keys[:, slots, :, at:at + W, :] = block_keys
    values[:, slots, :, at:at + W, :] = block_values
    return keys, values
