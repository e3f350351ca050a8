"""The rollout engine's decode step with fewer primitives (decode_graph = true; model plumbing for engine.py).

Up to ~256 rows a decode step on the H100 is host work: MLX dispatches every primitive of the step's graph
(~6 us each in MLX 0.32's CUDA backend), and decoder.decode_step's graph had 734 of them for SmolLM2, ~23 per
layer, of which only ~7 compute. This step computes the same forward with:

- the hidden state kept 2-D [rows, D] (one token per row), so no matmul is wrapped in Flatten/Unflatten and no
  residual add broadcasts;
- the layer matrices stored transposed ([in, out], made contiguous once per refresh), so no Transpose node
  precedes each matmul (o and down become copies: ~1/3 of a layer's weights more memory);
- the token's keys/values of all layers gathered by one concatenation (no stack of per-layer ExpandDims);
- the cache slot held as a device array [1] that the graph advances itself (`slot` -> `slot + 1`), with each
  row's RoPE position (slot - start) and step-key counter computed inside: no Python integer enters the
  graph, so one trace serves every cache length (mlx #3964: Python scalars are frozen into a compiled graph,
  and changing ones grow its cache).

The new keys/values are written into the cache as the default step writes them: by the fused kernel in place
(write_cache), or else outside the compiled graph at a Python slice (the engine's loop index). A slice_update at
an array offset (inside the graph or outside) made the step 2.3x slower at 256 rows on the H100
(docs/benchmarks-history.md, third sitting). The static slice is not written in place either while a step still
reading the cache runs on the GPU (MLX keeps a kernel's inputs alive until it ends, so the update cannot be
donated): it copies the cache too, which write_cache avoids. The slot array still feeds the graph's RoPE positions
and masks.

The arithmetic is decoder.decode_step's, operation for operation; only the matmuls' operand layout differs
(x @ W' with W' = W^T stored contiguous), which can change a float's last bits on some backends. Tests: the
engine's tokens and log-probs with and without it (CPU, float32), one trace for every cache length.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_grpo.kernels.fused_attention import fused_decode_attention
from mlx_grpo.models.decoder import Spec, cache_attention, fused_serves, merge_own_slot

MATRICES = ("qkv", "o", "gate_up", "down")


def graph_weights(weights: dict) -> dict:
    """The decoder.build copy with each layer matrix stored transposed, [in, out] contiguous."""
    layers = [{k: (mx.contiguous(v.T) if k in MATRICES else v) for k, v in lw.items()} for lw in weights["layers"]]
    out = {**weights, "layers": layers}
    mx.eval(out)
    return out


def model_layout(weights: dict) -> dict:
    """graph_weights' tree seen in decoder.build's layout ([out, in] views, no copy): for decoder.prefill."""
    layers = [{k: (v.T if k in MATRICES else v) for k, v in lw.items()} for lw in weights["layers"]]
    return {**weights, "layers": layers}


def _linear(x: mx.array, w: dict, name: str, residual: mx.array | None = None) -> mx.array:
    """residual + x @ w[name] + bias, as decoder's _linear/_plus_linear round it (addmm when there is one add)."""
    bias = w.get(name + "_b")
    if residual is None:
        return x @ w[name] if bias is None else mx.addmm(bias, x, w[name])
    if bias is not None:
        return residual + mx.addmm(bias, x, w[name])
    return mx.addmm(residual, x, w[name])


def decode_step(spec: Spec, w: dict, token: mx.array, keys: mx.array, values: mx.array, slot: mx.array,
                start: mx.array, kernel: bool, fuse: bool = True, write_cache: bool = False):
    """One token per row, the fed token written at cache slot `slot` [1]: token [n] at RoPE position
    slot - start[r], attending cache slots [start[r], slot) plus itself; keys, values [layers, n, Hkv, S, Dh];
    w from graph_weights; fuse=False keeps RoPE and attention as the default engine runs them (the bench's
    comparison). -> (logits [n, V], the token's keys and values [layers, n, Hkv, 1, Dh]); write_cache: the fused
    kernel also writes them at `slot` in place (decoder.decode_step)."""
    n = token.shape[0]
    H, Hkv, Dh, eps = spec.heads, spec.kv_heads, spec.head_dim, spec.eps
    offset = slot - start  # [n]
    x = w["embed"][token]  # [n, D]
    new_keys, new_values = [], []
    fused = fuse and fused_serves(spec, kernel)
    assert fused or not write_cache, "write_cache needs the fused kernel: the caller would write nothing"
    for layer, lw in enumerate(w["layers"]):
        qkv = _linear(mx.fast.rms_norm(x, lw["ln1"], eps), lw, "qkv")  # [n, (H + 2 Hkv) Dh]
        if fused:  # RoPE, attention and the own slot in one launch
            out, k, v = fused_decode_attention(qkv, keys, values, start, slot, offset, spec.theta, spec.scale, H,
                                               layer, write_cache)
        else:
            q, k, v = mx.split(qkv, [H * Dh, (H + Hkv) * Dh], axis=-1)
            # one position: [n, heads * Dh] is [n, heads, 1, Dh] in memory, as decoder's transposes give it
            q, k, v = q.reshape(n, H, 1, Dh), k.reshape(n, Hkv, 1, Dh), v.reshape(n, Hkv, 1, Dh)
            if spec.qk_norm:
                q, k = mx.fast.rms_norm(q, lw["q_norm"], eps), mx.fast.rms_norm(k, lw["k_norm"], eps)
            q, k = spec.rope(q, offset=offset), spec.rope(k, offset=offset)
            cached, lse = cache_attention(q, keys, values, start, slot, spec.scale, kernel, layer)
            out = merge_own_slot(q, k, v, cached, lse, spec.scale).astype(x.dtype)
        x = _linear(out.reshape(n, H * Dh), lw, "o", residual=x)
        gate, up = mx.split(_linear(mx.fast.rms_norm(x, lw["ln2"], eps), lw, "gate_up"), 2, axis=-1)
        x = _linear(nn.silu(gate) * up, lw, "down", residual=x)
        new_keys.append(k)
        new_values.append(v)
    x = mx.fast.rms_norm(x, w["norm"], eps)
    logits = x @ w.get("head", w["embed"]).T
    # [n, Hkv, 1, Dh] per layer -> [n, Hkv, layers, Dh] by one concatenation -> [layers, n, Hkv, 1, Dh] (views)
    def gather(parts):
        return mx.concatenate(parts, axis=2).transpose(2, 0, 1, 3)[:, :, :, None, :]
    return logits, gather(new_keys), gather(new_values)


def make_step(spec: Spec, sample, eos: mx.array, kernel: bool, on_trace=None, fuse: bool = True,
              write_cache: bool = False):
    """The compiled step: (weights, token, keys, values, slot, start, kstep, row_keys, ended) -> (token,
    logprob, entropy, ended, new_keys, new_values, slot + 1, kstep + 1). sample(logits, row_keys) ->
    (token, logprob, entropy); eos [E] int32 ids that end a row. on_trace() is called each time MLX traces it
    (to count compilations)."""

    def step(weights, token, keys, values, slot, start, kstep, row_keys, ended):
        if on_trace is not None:
            on_trace()
        logits, new_k, new_v = decode_step(spec, weights, token, keys, values, slot, start, kernel, fuse,
                                           write_cache)
        token, logprob, entropy = sample(logits, row_keys)
        ended = ended | (token[:, None] == eos[None]).any(axis=1)
        return token, logprob, entropy, ended, new_k, new_v, slot + 1, kstep + 1

    return mx.compile(step)
