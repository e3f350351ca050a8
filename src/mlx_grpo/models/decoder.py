"""The sampling copy of a llama-family policy and its decode step (model plumbing for rollout/engine.py).

The copy holds plain arrays in the compute dtype: q/k/v fused into one matrix and gate/up into another
(two matmuls per layer instead of five), LoRA/DoRA adapters merged into their base weights (an adapter
rollout costs what a full one does). It computes mlx-lm's llama/mistral/qwen2/qwen3 forward (same norms,
RoPE module, biases, tied head) with fewer launches: fused matrices, residual adds inside the matmuls
(addmm: one rounding where the model has two), attention in float32. Its log-probs equal the training
forward's in float32 (tests: 2e-5) and differ within bfloat16's rounding in bfloat16 (tests: a mean of
~0.004 nats per token on a tiny model), the level at which the sampler_kl metric and rollout_correction
already see any two attention implementations differ.

A decode step is one function of (weights, token, cache) that the engine compiles whole. The new token's own
key/value enter attention through a log-sum-exp merge with the cached slots' attention, and come back as
outputs, which the engine writes into the cache outside the compiled graph (inside one, MLX's slice_update
copies the whole buffer every step; outside, it still copies while an earlier step reading the cache runs on
the GPU). Where the fused CUDA kernel serves (fused_serves), it writes them into the cache itself, in place
(write_cache): MLX sees a step that only reads the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mlx_grpo.kernels import available
from mlx_grpo.kernels.attention import HEAD_DIMS, left_padded_attention_lse
from mlx_grpo.kernels.fused_attention import fused_decode_attention

FAMILIES = {"llama", "mistral", "qwen2", "qwen3"}


@dataclass(frozen=True)
class Spec:
    """The shape facts the step needs, and the model's own RoPE module (it holds no trained weights)."""

    heads: int
    kv_heads: int
    head_dim: int
    scale: float  # the attention modules' own score scale
    eps: float
    rope: object
    qk_norm: bool  # qwen3: RMSNorm over each head's queries and keys before RoPE
    theta: mx.array | None = None  # [Dh / 2] RoPE angle per position, when `rope` is a plain rotation


def supports(model: nn.Module) -> bool:
    """Whether this model's forward is the one the copy computes: a llama-family decoder whose layers all
    attend over the whole context (no sliding windows, no recurrent state)."""
    if getattr(model, "model_type", None) not in FAMILIES or not hasattr(model, "model"):
        return False
    if hasattr(model, "make_cache"):
        from mlx_lm.models.cache import KVCache

        if not all(type(c) is KVCache for c in model.make_cache()):
            return False
    return all(not getattr(layer, "use_sliding", False) for layer in model.model.layers)


def _dense(module: nn.Module) -> tuple[mx.array, mx.array | None]:
    """(weight [out, in], bias or None) of a linear layer, with a LoRA/DoRA adapter merged in and a
    quantized weight dequantized."""
    if hasattr(module, "fuse") and hasattr(module, "linear"):  # mlx-lm's LoRALinear / DoRALinear
        module = module.fuse(dequantize=True)
    weight = module.weight
    if isinstance(module, nn.QuantizedLinear):
        weight = mx.dequantize(weight, module.scales, module.biases, group_size=module.group_size,
                               bits=module.bits, mode=getattr(module, "mode", "affine"))
    return weight, module.get("bias") if "bias" in module else None


def _stack(parts: list[tuple[mx.array, mx.array | None]], dtype) -> tuple[mx.array, mx.array | None]:
    # a single part is the model's own array (no copy) unless merging or a cast made a new one
    weight = (mx.concatenate([w for w, _ in parts]) if len(parts) > 1 else parts[0][0]).astype(dtype)
    biases = [b for _, b in parts]
    if all(b is None for b in biases):
        return weight, None
    filled = [b if b is not None else mx.zeros((w.shape[0],), dtype=dtype) for (w, _), b in zip(parts, biases)]
    return weight, (mx.concatenate(filled) if len(filled) > 1 else filled[0]).astype(dtype)


def copy_bytes(model: nn.Module, dtype) -> int:
    """Bytes the copy adds to the model's own: the fused q/k/v and gate/up matrices, and every projection
    an adapter wraps (merged into a new matrix); the rest is shared with the model."""
    total = 0
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        parts = ((a.q_proj, True), (a.k_proj, True), (a.v_proj, True), (a.o_proj, False), (m.gate_proj, True),
                 (m.up_proj, True), (m.down_proj, False))
        for module, fused in parts:
            base = getattr(module, "linear", module)  # an adapter's base layer
            if fused or base is not module or base.weight.dtype != dtype:
                total += base.weight.shape[0] * base.weight.shape[1] * dtype.size
    return total


def spec_of(model: nn.Module) -> Spec:
    """The copy's shape of `model` (a model `supports` accepts): heads, head size, norms and RoPE."""
    inner = model.model
    attn0 = inner.layers[0].self_attn
    heads, kv_heads = attn0.n_heads, attn0.n_kv_heads
    rows = _dense(attn0.q_proj)[0].shape[0]  # heads x head_dim (qwen2's modules keep no head_dim)
    return Spec(heads=heads, kv_heads=kv_heads, head_dim=rows // heads, scale=attn0.scale,
                eps=inner.layers[0].input_layernorm.eps, rope=attn0.rope, qk_norm=hasattr(attn0, "q_norm"),
                theta=rope_angles(attn0.rope, rows // heads))


def writes_in_place(spec: Spec) -> bool:
    """Whether the copy's decode step can write each token's keys and values into the cache in place: the fused
    CUDA kernel serves it (the engine's write_in_step, its default, then does); otherwise each step writes a new
    cache while the last step still reads the old."""
    return fused_serves(spec, kernel_serves(spec))


def steps_write_cache(model: nn.Module) -> bool:
    """writes_in_place for `model`'s copy, before any copy is built (the memory check)."""
    return writes_in_place(spec_of(model))


def build(model: nn.Module, dtype) -> tuple[Spec, dict]:
    """The sampling copy of `model`'s current weights: (spec, weights), weights a tree of arrays."""
    inner = model.model
    spec = spec_of(model)
    layers = []
    for layer in inner.layers:
        a, m = layer.self_attn, layer.mlp
        qkv, qkv_b = _stack([_dense(a.q_proj), _dense(a.k_proj), _dense(a.v_proj)], dtype)
        o, o_b = _stack([_dense(a.o_proj)], dtype)
        gate_up, gate_up_b = _stack([_dense(m.gate_proj), _dense(m.up_proj)], dtype)
        down, down_b = _stack([_dense(m.down_proj)], dtype)
        entry = {"ln1": layer.input_layernorm.weight.astype(dtype), "qkv": qkv, "o": o,
                 "ln2": layer.post_attention_layernorm.weight.astype(dtype), "gate_up": gate_up, "down": down}
        for name, bias in (("qkv_b", qkv_b), ("o_b", o_b), ("gate_up_b", gate_up_b), ("down_b", down_b)):
            if bias is not None:
                entry[name] = bias
        if spec.qk_norm:
            entry["q_norm"], entry["k_norm"] = a.q_norm.weight.astype(dtype), a.k_norm.weight.astype(dtype)
        layers.append(entry)
    # a quantized embedding never gets here: the engine decodes quantized models themselves
    weights = {"embed": inner.embed_tokens.weight.astype(dtype), "norm": inner.norm.weight.astype(dtype), "layers": layers}
    if hasattr(model, "lm_head"):
        weights["head"] = _dense(model.lm_head)[0].astype(dtype)
    mx.eval(weights)
    return spec, weights


def rope_angles(rope, head_dim: int) -> mx.array | None:
    """theta [Dh / 2] such that rope(x, offset=p) turns each pair of dims (j, j + Dh/2) by p * theta[j] (the
    rotate-half layout of nn.RoPE, Llama3RoPE, ...), read off the module itself; None for a RoPE that is
    not such a rotation (traditional pairing, magnitude scaling), which the fused kernel cannot apply."""
    half = head_dim // 2
    # one position per vector: RoPE turns axis -2 as consecutive positions, so the probes go in the batch axis
    probe = mx.concatenate([mx.eye(half), mx.zeros((half, half))], axis=1)[:, None, None]  # e_j, j < Dh/2
    turned = rope(probe, offset=1)[:, 0, 0]  # row j: cos at j, sin at j + Dh/2
    idx = mx.arange(half)
    theta = mx.arctan2(turned[idx, idx + half], turned[idx, idx]).astype(mx.float32)
    x = mx.random.normal((3, 2, 1, head_dim), key=mx.random.key(0))
    for p in (0, 5, 1000):
        angle = p * theta
        c, s = mx.cos(angle), mx.sin(angle)
        a, b = x[..., :half], x[..., half:]
        mine = mx.concatenate([a * c - b * s, b * c + a * s], axis=-1)
        if not mx.allclose(mine, rope(x, offset=p), atol=1e-3).item():
            return None
    return theta


def prefill_layout(weights: dict) -> dict:
    """weights (build's tree, or compiled_decode.model_layout's) with each matrix's transpose beside it, as
    name + ".T", evaluated once: strided views of the same memory (no copy), which prefill and prefill_after
    read instead of dispatching a transpose per matrix per call (4 per layer and 1 for the head, at every refill).
    The matmuls see the same strides either way: the same results."""
    def with_t(w: dict, names) -> dict:
        return {**w, **{name + ".T": w[name].T for name in names if name in w}}

    out = with_t({**weights, "layers": [with_t(lw, ("qkv", "o", "gate_up", "down")) for lw in weights["layers"]]},
                 ("head",) if "head" in weights else ("embed",))
    mx.eval(out)
    return out


def _t(w: dict, name: str) -> mx.array:
    """w[name].T: prefill_layout's view where the tree has one."""
    t = w.get(name + ".T")
    return w[name].T if t is None else t


def _linear(x: mx.array, w: dict, name: str) -> mx.array:
    bias = w.get(name + "_b")
    return x @ _t(w, name) if bias is None else mx.addmm(bias, x, _t(w, name))


def _qkv(spec: Spec, w: dict, x: mx.array, offset) -> tuple[mx.array, mx.array, mx.array]:
    """Queries [n, H, L, Dh] and keys, values [n, Hkv, L, Dh] of hidden states x [n, L, D], with RoPE at
    positions offset + 0..L-1 (offset: int or [n])."""
    n, L, _ = x.shape
    H, Hkv, Dh = spec.heads, spec.kv_heads, spec.head_dim
    qkv = _linear(mx.fast.rms_norm(x, w["ln1"], spec.eps), w, "qkv")  # [n, L, (H + 2 Hkv) Dh]
    q, k, v = mx.split(qkv, [H * Dh, (H + Hkv) * Dh], axis=-1)
    q, k, v = q.reshape(n, L, H, Dh), k.reshape(n, L, Hkv, Dh), v.reshape(n, L, Hkv, Dh)
    if spec.qk_norm:
        q, k = mx.fast.rms_norm(q, w["q_norm"], spec.eps), mx.fast.rms_norm(k, w["k_norm"], spec.eps)
    q, k, v = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    return spec.rope(q, offset=offset), spec.rope(k, offset=offset), v


def _plus_linear(x: mx.array, inputs: mx.array, w: dict, name: str) -> mx.array:
    """x + linear(inputs): the residual add rides in the matmul (addmm) when there is no bias."""
    if name + "_b" in w:
        return x + _linear(inputs, w, name)
    return mx.addmm(x, inputs, _t(w, name))


def _finish_layer(w: dict, x: mx.array, attended: mx.array, eps: float) -> mx.array:
    """Output projection, residual, MLP, residual. attended [n, H, L, Dh], x [n, L, D] -> [n, L, D]."""
    n, _, L, _ = attended.shape
    # one position: [n, H, 1, Dh] is already laid out as [n, 1, H * Dh] (no transpose copy)
    flat = attended.reshape(n, 1, -1) if L == 1 else attended.transpose(0, 2, 1, 3).reshape(n, L, -1)
    x = _plus_linear(x, flat, w, "o")
    gate, up = mx.split(_linear(mx.fast.rms_norm(x, w["ln2"], eps), w, "gate_up"), 2, axis=-1)
    return _plus_linear(x, nn.silu(gate) * up, w, "down")


def _logits(w: dict, spec: Spec, x: mx.array) -> mx.array:
    x = mx.fast.rms_norm(x, w["norm"], spec.eps)
    return x @ _t(w, "head" if "head" in w else "embed")


def prefill(spec: Spec, w: dict, tokens: mx.array, left_padding: mx.array):
    """Run left-padded prompts tokens [n, L] (row r has left_padding[r] pads first) -> (last logits
    [n, V], keys and values per layer [n, Hkv, L, Dh]). Positions start at 0 on each row's first real
    token, as mlx-lm's BatchKVCache gives them."""
    n, L = tokens.shape
    slots = mx.arange(L)
    mask = (slots[None, :] <= slots[:, None])[None, None] & (slots >= left_padding[:, None, None, None])
    x = w["embed"][tokens]  # [n, L, D]
    keys, values = [], []
    for lw in w["layers"]:
        q, k, v = _qkv(spec, lw, x, -left_padding)
        attended = mx.fast.scaled_dot_product_attention(q, k, v, scale=spec.scale, mask=mask)
        x = _finish_layer(lw, x, attended, spec.eps)
        keys.append(k)
        values.append(v)
    return _logits(w, spec, x[:, -1, :]), keys, values


def prefill_after(spec: Spec, w: dict, tokens: mx.array, left_padding: mx.array, keys: mx.array,
                  values: mx.array, start: mx.array):
    """Prefill chunks on top of kept caches. Row r's context is slots [start[r], W) of a W-slot timeline:
    its past, already in keys, values [layers, n, Hkv, W, Dh], then its chunk, the real tokens of tokens
    [n, C] (left_padding[r] pads first), at the timeline's last C - left_padding[r] slots. The token at
    slot t sits at RoPE position t - start[r] and attends slots [start[r], t]. -> (last logits [n, V],
    keys and values [layers, n, Hkv, W, Dh]: the past with the chunk's own written in)."""
    n, C = tokens.shape
    first = keys.shape[3] - C  # the timeline slot of tokens[:, 0]
    slots, query = mx.arange(keys.shape[3]), first + mx.arange(C)
    # a pad sees at least its own slot: no softmax over nothing (its output is never used)
    mask = ((slots[None, :] <= query[:, None])[None] & (slots >= start[:, None, None])) \
        | (slots[None, :] == query[:, None])[None]
    fresh = (mx.arange(C)[None, :] >= left_padding[:, None])[:, None, :, None]  # [n, 1, C, 1]
    x = w["embed"][tokens]  # [n, C, D]
    out_keys, out_values = [], []
    for layer, lw in enumerate(w["layers"]):
        q, k, v = _qkv(spec, lw, x, first - start)
        k = mx.concatenate([keys[layer, :, :, :first], mx.where(fresh, k, keys[layer, :, :, first:])], axis=2)
        v = mx.concatenate([values[layer, :, :, :first], mx.where(fresh, v, values[layer, :, :, first:])], axis=2)
        attended = mx.fast.scaled_dot_product_attention(q, k, v, scale=spec.scale, mask=mask[:, None])
        x = _finish_layer(lw, x, attended, spec.eps)
        out_keys.append(k)
        out_values.append(v)
    return _logits(w, spec, x[:, -1, :]), mx.stack(out_keys), mx.stack(out_values)


def cache_attention(q: mx.array, keys: mx.array, values: mx.array, start: mx.array, stop: mx.array,
                    scale: float, kernel: bool, layer: int) -> tuple[mx.array, mx.array]:
    """Attention of one query per row over cache slots [start[r], stop[0]) of layer `layer`, with its
    log-sum-exp. q [n, H, 1, Dh]; keys, values [layers, n, Hkv, S, Dh] -> (out [n, H, 1, Dh], lse [n, H, 1]
    float32)."""
    if kernel:
        return left_padded_attention_lse(q, keys, values, scale, start, stop, layer)
    keys, values = keys[layer], values[layer]
    n, H, _, Dh = q.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    qg = q.reshape(n, Hkv, H // Hkv, Dh).astype(mx.float32)  # the query heads of each kv head
    scores = (qg @ keys.astype(mx.float32).transpose(0, 1, 3, 2)) * scale  # [n, Hkv, H/Hkv, S]
    slots = mx.arange(S)
    visible = (slots[None, :] >= start[:, None]) & (slots[None, :] < stop)  # [n, S]
    scores = mx.where(visible[:, None, None, :], scores, -mx.inf)
    lse = mx.logsumexp(scores, axis=-1, keepdims=True)  # [n, Hkv, H/Hkv, 1]
    seen = lse > -mx.inf  # a row with no slot gives out 0 and lse -inf, as the kernel does
    out = mx.where(seen, mx.exp(scores - mx.where(seen, lse, 0)), 0) @ values.astype(mx.float32)  # [n, Hkv, H/Hkv, Dh]
    return out.reshape(n, H, 1, Dh).astype(q.dtype), lse.reshape(n, H, 1)


def merge_own_slot(q: mx.array, k: mx.array, v: mx.array, out: mx.array, lse: mx.array, scale: float) -> mx.array:
    """The cached slots' attention (out [n, H, 1, Dh], lse [n, H, 1]) merged with the token's own slot (q
    [n, H, 1, Dh], its k, v [n, Hkv, 1, Dh]): softmax weights exp(lse) and exp(q.k). -> float32 [n, H, 1, Dh]."""
    n, H, _, Dh = q.shape
    Hkv = k.shape[1]
    qg = q.reshape(n, Hkv, H // Hkv, Dh).astype(mx.float32)
    own = ((qg * k.astype(mx.float32)).sum(-1) * scale).reshape(n, H, 1)  # [n, H, 1]
    top = mx.maximum(lse, own)
    a, b = mx.exp(lse - top), mx.exp(own - top)
    v_rep = mx.repeat(v, H // Hkv, axis=1).astype(mx.float32)  # [n, H, 1, Dh]
    return (out.astype(mx.float32) * a[..., None] + v_rep * b[..., None]) / (a + b)[..., None]


def fused_serves(spec: Spec, kernel: bool) -> bool:
    """Whether a decode step runs each layer's attention as one fused launch (kernels/fused_attention.py: RoPE
    by angles, no qk-norm), which can also write the token's key and value into the cache (write_cache)."""
    return kernel and spec.theta is not None and not spec.qk_norm


def decode_step(spec: Spec, w: dict, token: mx.array, keys: mx.array, values: mx.array, offset: mx.array,
                start: mx.array, stop: mx.array, kernel: bool, write_cache: bool = False):
    """One token per row: token [n] at RoPE position offset [n], attending cache slots [start, stop) plus
    itself; keys, values [layers, n, Hkv, S, Dh]. -> (logits [n, V], the token's keys and values
    [layers, n, Hkv, 1, Dh]). Reads the cache only (the caller writes the returned keys/values at slot stop),
    unless write_cache and fused_serves: the fused kernel then writes them there in place."""
    H, scale = spec.heads, spec.scale
    x = w["embed"][token][:, None, :]  # [n, 1, D]
    new_keys, new_values = [], []
    fused = fused_serves(spec, kernel)
    assert fused or not write_cache, "write_cache needs the fused kernel: the caller would write nothing"
    for layer, lw in enumerate(w["layers"]):
        if fused:  # RoPE, attention and the own slot in one launch
            qkv = _linear(mx.fast.rms_norm(x, lw["ln1"], spec.eps), lw, "qkv")[:, 0, :]  # [n, (H + 2 Hkv) Dh]
            out, k, v = fused_decode_attention(qkv, keys, values, start, stop, offset, spec.theta, scale, H, layer,
                                               write_cache)
            x = _finish_layer(lw, x, out, spec.eps)
            new_keys.append(k)
            new_values.append(v)
            continue
        q, k, v = _qkv(spec, lw, x, offset)  # [n, H, 1, Dh], [n, Hkv, 1, Dh] x2
        out, lse = cache_attention(q, keys, values, start, stop, scale, kernel, layer)
        x = _finish_layer(lw, x, merge_own_slot(q, k, v, out, lse, scale).astype(x.dtype), spec.eps)
        new_keys.append(k)
        new_values.append(v)
    return _logits(w, spec, x[:, 0, :]), mx.stack(new_keys), mx.stack(new_values)


def kernel_serves(spec: Spec) -> bool:
    """Whether the CUDA cache-attention kernels serve this shape (else the reference attention runs)."""
    return available() and spec.head_dim in HEAD_DIMS
