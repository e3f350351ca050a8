"""The model's own one-token decode step with the CUDA decode-attention kernel (rollout/decode.py's
fixed-capacity cache path): mlx-lm's llama / mistral / qwen2 / qwen3 forward, run layer by layer on the model's
own modules (adapters and quantized layers included), with attention through the cache's `attend`.

Why a forward of our own: mlx-lm's attention modules call their module's global `scaled_dot_product_attention`
(mlx_lm.models.base), which dispatches on the cache only for quantized caches (`cache.bits`, to quantized
matmuls) and otherwise calls `mx.fast.scaled_dot_product_attention` with the cache's mask; MLX 0.32's CUDA
decode kernel takes no mask array, so a masked call falls back to unfused ops on a copied slice. No argument
mlx-lm passes reaches our kernel instead. The rollout used to swap that module global for the rollout's
duration (process-wide, for every model of the family); this step computes what the model's forward computes,
op for op in mlx-lm's order, and mutates nothing. tests/test_rollout.py checks its logits equal the model's own
call bit for bit for each family, on the same caches.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_grpo.kernels import available
from mlx_grpo.kernels.attention import HEAD_DIMS

# The families whose forward decode_step computes (llama-style attention + MLP layers; mistral loads as llama),
# and the mlx-lm modules their Model classes come from.
KERNEL_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}
MLX_LM_MODULES = {"mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3"}


def forward_matches(model: nn.Module) -> bool:
    """decode_step computes this model's forward: an mlx-lm llama / mistral / qwen2 / qwen3 Model."""
    return getattr(model, "model_type", None) in KERNEL_MODEL_TYPES and type(model).__module__ in MLX_LM_MODULES


def serves(model: nn.Module, head_dim: int) -> bool:
    """The kernel can take this model's decode attention (through decode_step)."""
    return available() and forward_matches(model) and head_dim in HEAD_DIMS


def _attention(attn: nn.Module, x: mx.array, mask, cache) -> mx.array:
    """mlx-lm's llama / qwen2 / qwen3 Attention.__call__ on a cache, attending through cache.attend."""
    B, L, _ = x.shape
    queries, keys, values = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    queries = queries.reshape(B, L, attn.n_heads, -1)
    keys = keys.reshape(B, L, attn.n_kv_heads, -1)
    if "q_norm" in attn:  # qwen3: RMSNorm over each head before RoPE
        queries, keys = attn.q_norm(queries), attn.k_norm(keys)
    queries = queries.transpose(0, 2, 1, 3)
    keys = keys.transpose(0, 2, 1, 3)
    values = values.reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    queries = attn.rope(queries, offset=cache.offset)
    keys = attn.rope(keys, offset=cache.offset)
    keys, values = cache.update_and_fetch(keys, values)
    output = cache.attend(queries, keys, values, attn.scale, mask)
    return attn.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


def decode_step(model: nn.Module, inputs: mx.array, cache: list) -> mx.array:
    """model(inputs, cache=cache) for a model forward_matches, with each layer's attention through its cache's
    `attend` (the kernel's, on rollout/decode.StaticBatchCache). inputs [N, L] -> logits [N, L, V]."""
    inner = model.model
    h = inner.embed_tokens(inputs)
    mask = cache[0].make_mask(h.shape[1], return_array=False, window_size=None)  # create_attention_mask's call
    for layer, layer_cache in zip(inner.layers, cache):
        h = h + _attention(layer.self_attn, layer.input_layernorm(h), mask, layer_cache)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    out = inner.norm(h)
    return inner.embed_tokens.as_linear(out) if model.args.tie_word_embeddings else model.lm_head(out)
