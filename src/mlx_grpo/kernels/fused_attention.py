"""The rollout engine copy's whole attention for one layer of a decode step, in one CUDA launch
(fused_decode_attention, called by models/decoder.py and models/compiled_decode.py), beside its MLX reference
(fused_decode_attention_reference): RoPE on the token's query and key, attention over the cache slots
[start, stop) plus the token's own slot, and the token's key and value for the cache write. It shares the
slot loop and the 16-byte layout of kernels/attention.py.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from mlx_grpo.kernels.attention import HEAD_DIMS, LAYER_OF_STACK, LAYOUT, MERGE_GROUPS, SLOT_LOOP, scale_array

# The decode step's whole attention for one layer of the rollout engine's copy (models/decoder.py), in one
# launch: RoPE on the token's query and key (rotate-half layout, angles pos * theta), attention over the
# cache slots [start, stop) plus the token's own slot, and the token's key/value for the cache write.
# It replaces ~8 launches per layer (split copies, two RoPEs, attention, the own-slot merge).
# Each (row, head)'s slots are split across SPLIT warps of one 8-warp block, merged through shared memory
# (flash-decoding's split): one warp per (row, head) ran as a single wave of ~17 warps per SM on an H100 at
# 256 rows, each warp walking its whole row; a CUPTI trace put that kernel at half a rollout's GPU time.
_FUSED_SOURCE = LAYOUT + """
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
""" + SLOT_LOOP + """
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
""" + MERGE_GROUPS.replace("MERGED_STORE", "part_acc[wib][ELEMENT(i)] = a") + """
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
                if (WRITE && end < S) {  // write_cache: the token's slot of the cache, in place
                    const_cast<T*>(kbase)[(size_t)end * D + ELEMENT(i)] = static_cast<T>(k_new[i]);
                    const_cast<T*>(vbase)[(size_t)end * D + ELEMENT(i)] = static_cast<T>(v_new[i]);
                }
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
                               source=_FUSED_SOURCE.replace("LAYER_BASE", LAYER_OF_STACK))


def fused_split(rows: int, heads: int, head_dim: int) -> tuple[int, int]:
    """(SPLIT warps per (row, head), NB batches per trip) of the fused kernel. Measured on an H100
    (docs/benchmarks-history.md, eleventh sitting; 30-call chains, 170-420 cached slots): at 256 rows x 9 heads, 4 warps
    and 4 batches took 15-20% less time than one warp and 2; at 1,024 rows splitting lost (up to +17%) and
    at 64 it was mixed. 128-wide heads keep 2 batches: 4 would hold 128 floats of keys and values per lane."""
    split = 4 if 1024 <= rows * heads <= 4096 else 1
    return split, (4 if head_dim == 64 else 2)


def fused_decode_attention(qkv: mx.array, keys: mx.array, values: mx.array, start: mx.array, stop: mx.array,
                           positions: mx.array, theta: mx.array, scale: float, heads: int, layer: int,
                           write_cache: bool = False):
    """RoPE + attention of each row's new token over cache slots [start[r], stop[0]) of layer `layer` and
    itself. qkv [N, (Hq + 2 Hkv) D] the token's projections (pre-RoPE); keys, values [layers, N, Hkv, S, D];
    positions [N] int32 RoPE positions; theta [D / 2] float32 angles per position. -> (out [N, Hq, 1, D],
    the token's RoPE'd key and its value, each [N, Hkv, 1, D]).

    write_cache: also write the token's key and value into slot stop[0] of keys, values, in place. MLX does not
    see that write: only for a cache whose buffer no other array shares, read after the step has run (the
    engine's sampling copy). It spares the step the write MLX would make outside: a slice update whose input
    an earlier step still reads on the GPU cannot be donated, so it copied the whole cache every step."""
    N = qkv.shape[0]
    _, _, Hkv, S, D = keys.shape
    assert D in HEAD_DIMS and heads % Hkv == 0 and qkv.shape[1] == (heads + 2 * Hkv) * D
    # write_cache writes at row N's offsets of keys/values: their rows must be qkv's
    assert keys.shape[1] == N and values.shape == keys.shape
    split, batches = fused_split(N, heads, D)
    blocks = -(-N * heads * split // 8)  # 8 warps a block; a (row, head)'s parts never straddle two
    return _fused_kernel()(
        inputs=[qkv, keys, values, start, stop, positions, theta, scale_array(float(scale)),
                mx.array([N, S], dtype=mx.int32), mx.array([layer], dtype=mx.int32)],
        template=[("T", qkv.dtype), ("D", D), ("HQ", heads), ("HKV", Hkv), ("SPLIT", split), ("NB", batches),
                  ("WRITE", int(write_cache))],
        grid=(blocks * 256, 1, 1), threadgroup=(256, 1, 1),
        output_shapes=[(N, heads, 1, D), (N, Hkv, 1, D), (N, Hkv, 1, D)],
        output_dtypes=[qkv.dtype] * 3)


def fused_decode_attention_reference(qkv: mx.array, keys: mx.array, values: mx.array, start: mx.array,
                                     stop: mx.array, positions: mx.array, theta: mx.array, scale: float, heads: int,
                                     layer: int):
    """What fused_decode_attention computes, in plain MLX: rotate-half RoPE in float32 rounded to qkv's dtype (as
    the kernel rounds it), then masked attention in float32 over layer `layer`'s slots [start[r], stop[0]) and
    the token's own slot. -> (out [N, Hq, 1, D] float32, key, value [N, Hkv, 1, D] in qkv's dtype)."""
    f32 = mx.float32
    N = qkv.shape[0]
    _, _, Hkv, S, D = keys.shape
    angle = positions[:, None, None].astype(f32) * theta  # [N, 1, D / 2]
    cos, sin = mx.cos(angle), mx.sin(angle)

    def rope(x):  # [N, H, D]
        a, b = x[..., :D // 2].astype(f32), x[..., D // 2:].astype(f32)
        return mx.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(qkv.dtype)

    split = qkv.reshape(N, heads + 2 * Hkv, D)
    q, k, v = rope(split[:, :heads]), rope(split[:, heads:heads + Hkv]), split[:, heads + Hkv:]
    k_all = mx.concatenate([keys[layer], k[:, :, None]], axis=2).astype(f32)  # [N, Hkv, S + 1, D]
    v_all = mx.concatenate([values[layer], v[:, :, None]], axis=2).astype(f32)
    slots = mx.arange(S + 1)
    mask = (((slots[None] >= start[:, None]) & (slots[None] < stop[0])) | (slots[None] == S))[:, None, None, :]
    out = mx.fast.scaled_dot_product_attention(q[:, :, None].astype(f32), k_all, v_all, scale=scale, mask=mask)
    return out, k[:, :, None], v[:, :, None]
