"""The sampler's per-row draws on NVIDIA GPUs: each row's Gumbel noise from its own key, bit for bit what
`mx.vmap(mx.random.categorical)` draws, from a kernel that writes the random bits coalesced; beside it MLX's
own vmapped draws (gumbel_reference, categorical_reference) and `categorical`, the sampler's one call: the
kernel where kernels.available(), MLX's own draws elsewhere.

MLX 0.32's CUDA random-bits kernel, vmapped over one key per row, has consecutive threads write single bytes
of rows a vocabulary apart (0.88 ms per decode step at 256 rows x 49,152 under ncu). This kernel runs the
same threefry2x32 hash on the same counters (row r's words y and y + H from one hash of (y, y + H),
H = ceil(V / 2); an odd V drops the last hash's second word) with consecutive threads on consecutive words.
The uniform -> Gumbel -> argmax that follows uses MLX's own ops in MLX's order, so the tokens match too.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

from mlx_grpo.kernels import available

_SOURCE = """
    const size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t rows = keys_shape[0];
    if (t >= rows * H) return;
    const uint32_t y = (uint32_t)(t % H);
    const size_t row = t / H;
    const uint32_t k0 = keys[2 * row], k1 = keys[2 * row + 1];
    const uint32_t ks[3] = {k0, k1, k0 ^ k1 ^ 0x1BD11BDAu};
    const bool drop = ODD && (y == H - 1);
    uint32_t x0 = y + ks[0];
    uint32_t x1 = (drop ? 0u : y + H) + ks[1];
    const int rot[2][4] = {{13, 15, 26, 6}, {17, 29, 16, 24}};
    #pragma unroll
    for (int i = 0; i < 5; ++i) {
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int r = rot[i % 2][j];
            x0 += x1;
            x1 = (x1 << r) | (x1 >> (32 - r));
            x1 ^= x0;
        }
        x0 += ks[(i + 1) % 3];
        x1 += ks[(i + 2) % 3] + i + 1;
    }
    out[row * V + y] = x0;
    if (!drop) out[row * V + y + H] = x1;
"""


@lru_cache(maxsize=1)
def _kernel():
    return mx.fast.cuda_kernel(name="mlx_grpo_keyed_bits", input_names=["keys"], output_names=["out"],
                               source=_SOURCE)


def keyed_bits(keys: mx.array, vocab: int) -> mx.array:
    """uint32 [N, vocab], row r = MLX's random bits for shape (vocab,) and key keys[r] (C++ `random::bits`;
    Python has none); keys [N, 2] uint32. CUDA only."""
    half = (vocab + 1) // 2
    return _kernel()(inputs=[keys], template=[("H", half), ("V", vocab), ("ODD", vocab % 2)],
                     grid=(keys.shape[0] * half, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(keys.shape[0], vocab)],
                     output_dtypes=[mx.uint32])[0]


_BELOW_ONE = float(np.nextafter(np.float32(1), np.float32(0)))


def gumbel_from_bits(bits: mx.array) -> mx.array:
    """mx.random.gumbel's noise from each row's random bits [N, V]: MLX's uniform (bits / (2^32 - 1), capped
    below 1; its range 1 and low 0 change no bit), then -log(-log(u)), in float32."""
    u = mx.minimum(bits / mx.array(4294967295.0, dtype=mx.float32), mx.array(_BELOW_ONE, dtype=mx.float32))
    return -mx.log(-mx.log(u))


def categorical_from_bits(logits: mx.array, bits: mx.array) -> mx.array:
    """mx.random.categorical(logits[r], key=keys[r]) per row, given bits [N, V] = each row's random bits: argmax
    of the logits plus their Gumbel noise, added in MLX's order."""
    return mx.argmax(gumbel_from_bits(bits) + logits, axis=-1)


def gumbel_reference(keys: mx.array, vocab: int) -> mx.array:
    """MLX's own Gumbel noise [N, vocab] for key keys[r] of each row: what gumbel_from_bits(keyed_bits(keys,
    vocab)) equals bit for bit."""
    return mx.vmap(lambda key: mx.random.gumbel(shape=(vocab,), key=key))(keys)


def categorical_reference(logits: mx.array, keys: mx.array) -> mx.array:
    """MLX's own draw mx.random.categorical(logits[r], key=keys[r]) per row. logits [N, V], keys [N, 2] -> [N]."""
    return mx.vmap(lambda row, key: mx.random.categorical(row, key=key))(logits, keys)


def categorical(logits: mx.array, keys: mx.array) -> mx.array:
    """One token per row drawn with the row's key, [N]: the keyed kernel's bits where the kernels run (the same
    tokens, written coalesced), MLX's own vmapped draw elsewhere."""
    if available():
        return categorical_from_bits(logits, keyed_bits(keys, logits.shape[-1]))
    return categorical_reference(logits, keys)
