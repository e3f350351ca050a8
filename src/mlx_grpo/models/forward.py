"""The training forward: log-probs of sampled completion tokens under a model, with gradients.

Owns the packed batch layout (right-padded prompt + completion rows, widths bucketed so the GPU backend
reuses its kernels, in multiples of 128 on CUDA so attention's backward runs fused), the model-family
table (LOGIT_SPLITS: which families take the hidden states at the completion positions only, and their
logit soft cap), the chunked output head with its hand-written backward pass (so [n, L, V] logits never
exist), and per-layer checkpointing (grad_checkpoint).
Log-probs are taken under logits / temperature, the distribution the sampler drew from. The objective
(loss.py) consumes these log-probs; it knows nothing about models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

from mlx_grpo.models.gated_delta import bounded_scan


def token_logprobs(logits: mx.array, tokens: mx.array, temperature: float, several: bool = False) -> mx.array:
    """log softmax(logits / temperature)[token], in float32. logits [..., V], tokens [...] -> [...]; with
    `several`, K tokens per position: tokens [..., K] -> [..., K]."""
    scaled = logits.astype(mx.float32) / temperature  # [..., V]
    return picked_logprobs(scaled, tokens, several)


def picked_logprobs(z: mx.array, tokens: mx.array, several: bool = False) -> mx.array:
    """log softmax(z)[tokens]: z [..., V], tokens [...] -> [...], or tokens [..., K] -> [..., K] (`several`)."""
    if several:
        return mx.take_along_axis(z, tokens, axis=-1) - mx.logsumexp(z, axis=-1, keepdims=True)  # [..., K]
    picked = mx.take_along_axis(z, tokens[..., None], axis=-1).squeeze(-1)  # [...]
    return picked - mx.logsumexp(z, axis=-1)  # [...]


@dataclass
class PackedBatch:
    """Prompt + completion rows, right-padded, with where each completion token's logit sits.

    inputs [n, L] token ids; positions [n, T] index of the logit that predicts completion token t;
    targets [n, T] the sampled completion ids ([n, T, K] inside completion_logprobs with `extra` ids);
    mask [n, T] 1 for real completion tokens.
    """

    inputs: mx.array
    positions: mx.array
    targets: mx.array
    mask: mx.array


# Sequence lengths are rounded up to a multiple of this: the GPU backend builds (and caches) kernels and
# attention plans per shape, and a new plan for every micro-batch costs more than the padding.
SHAPE_BUCKET = 64


def bucket(length: int, multiple: int = SHAPE_BUCKET) -> int:
    """length rounded up to a multiple of `multiple`."""
    return -(-length // multiple) * multiple


def row_bucket(rows: int) -> int:
    """rows rounded up to a power of two: the rows the sampling copy's prefills and its admitted rows' first
    sampling run on, so that MLX sees few shapes (on CUDA, cuDNN's attention builds a graph per new shape: ~90 ms,
    bench/admit_shapes.py); loop.rebuilt_rows pads rebuilt batches with it."""
    return 1 << (max(rows, 1) - 1).bit_length()


def rows_to_bucket(items: list) -> list:
    """items with its first repeated up to row_bucket(len(items)): the rows a prefill runs on, the extra ones
    dropped after (each row attends only to itself, so they change no real row)."""
    return list(items) + [items[0]] * (row_bucket(len(items)) - len(items))


# MLX's CUDA backend runs attention's backward as one cuDNN kernel only when the sequence length is a
# multiple of 128 (ScaledDotProductAttentionVJP::use_fallback); at other lengths it differentiates the
# unfused formula, ~10x slower per layer. Metal and CPU have no fused backward: 64 pads less there.
CUDA_PACK_BUCKET = 128


def pack_bucket() -> int:
    """The multiple packed widths are rounded up to on the current default device."""
    on_cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
    return CUDA_PACK_BUCKET if on_cuda else SHAPE_BUCKET


def packed_width(widest_prompt: int, completion_width: int, multiple: int | None = None) -> int:
    """Columns of a packed batch: the widest prompt plus the completion width, rounded up to `multiple`
    (default pack_bucket()). Every pass over one micro-batch uses the same width, so the log-prob and
    gradient passes see identical shapes."""
    return bucket(widest_prompt + completion_width, multiple or pack_bucket())


def pack(prompts: list[list[int]], completions: mx.array, mask: mx.array, pad_id: int,
         multiple: int | None = None) -> PackedBatch:
    """Right-pad each prompt+completion row (to packed_width's multiple); padding sits after every real
    token, so a causal model gives the real tokens exactly the logits they would get unpadded."""
    n, T = completions.shape
    lengths = [len(p) for p in prompts]
    width = packed_width(max(lengths), T, multiple)
    rows = []
    comp = completions.tolist()
    for prompt, completion in zip(prompts, comp):
        row = prompt + completion
        rows.append(row + [pad_id] * (width - len(row)))
    inputs = mx.array(rows, dtype=mx.int32)  # [n, L]
    positions = mx.array(lengths, dtype=mx.int32)[:, None] - 1 + mx.arange(T, dtype=mx.int32)[None]  # [n, T]
    return PackedBatch(inputs, positions, completions.astype(mx.int32), mask.astype(mx.float32))


class LogitSplit(NamedTuple):
    """How a model family computes its logits: u = head(inner(inputs)) on the module `outer`, then
    logits = cap * tanh(u / cap) with a soft cap, and / divide with a divisor. The head is the untied
    lm_head, else the tied embedding (output_head)."""

    outer: str  # attribute of the model holding head and inner ("" = the model itself)
    inner: str  # attribute of outer holding the inner model: inputs [n, L] -> final hidden states [n, L, D]
    softcap: float | str | None = None  # the cap, or the attribute of outer holding it
    divide: str | None = None  # attribute of outer the logits are divided by (Granite's logits_scaling)


# mlx-lm's nanochat applies `softcap(logits)` with its default cap=15.0 (mlx_lm/models/nanochat.py); the
# cap is neither a config field nor a module attribute there, so it is restated here.
NANOCHAT_SOFTCAP = 15.0

_PLAIN = LogitSplit("", "model")
# The model families whose logits completion_logprobs computes from hidden states at the completion
# positions only, each entry read off the family's Model.__call__ in mlx-lm; tests/test_families.py
# checks every entry against the model's own forward. Other model_types take the full-logits path.
LOGIT_SPLITS = {
    **{kind: _PLAIN for kind in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen3_next", "phi3",
                                 "olmo2", "smollm3", "ministral3", "exaone4", "glm4", "gemma3_text", "lfm2",
                                 "lfm2_moe", "gpt_oss")},
    **{kind: LogitSplit("language_model", "model") for kind in ("qwen3_5", "qwen3_5_moe")},
    **{kind: LogitSplit("", "model", softcap="final_logit_softcapping") for kind in ("gemma2", "gemma4_text")},
    **{kind: LogitSplit("", "model", divide="logits_scaling") for kind in ("granite", "granitemoehybrid")},
    "nanochat": LogitSplit("", "transformer", NANOCHAT_SOFTCAP),  # untied lm_head
}


class ResolvedSplit(NamedTuple):
    """A LogitSplit applied to one model: the modules and numbers completion_logprobs uses."""

    outer: nn.Module
    inner: nn.Module
    softcap: float | None
    divide: float | None


def logit_split(model: nn.Module) -> ResolvedSplit | None:
    """The model's LogitSplit resolved to its modules and numbers; None for the full-logits path."""
    split = LOGIT_SPLITS.get(getattr(model, "model_type", None))
    if split is None or not type(model).__module__.startswith("mlx_lm."):  # the table reads mlx-lm's classes
        return None
    outer = getattr(model, split.outer) if split.outer else model
    cap = getattr(outer, split.softcap, None) if isinstance(split.softcap, str) else split.softcap
    divide = getattr(outer, split.divide) if split.divide else None
    return ResolvedSplit(outer, getattr(outer, split.inner), cap, divide)


# Tokens per output-head chunk are chosen so one chunk's float32 logits stay near this many elements
# (2^25 floats = 128 MB): memory for log-probs is then bounded whatever the batch or vocabulary size.
LOGIT_CHUNK_ELEMENTS = 2 ** 25


def _tied(model: nn.Module) -> bool:
    """Whether the family's __call__ uses the embedding as its output head (flag on the module or its args)."""
    flag = getattr(model, "tie_word_embeddings", None)
    if flag is None:
        flag = getattr(getattr(model, "args", None), "tie_word_embeddings", None)
    return bool(flag)


def output_head(model: nn.Module) -> tuple[nn.Module, callable]:
    """The output head as (module owning its weights, function hidden [..., D] -> logits [..., V])."""
    if hasattr(model, "lm_head") and not _tied(model):
        return model.lm_head, model.lm_head
    embed = model.model.embed_tokens
    return embed, embed.as_linear


def soft_capped(logits: mx.array, softcap: float | None) -> mx.array:
    """softcap * tanh(logits / softcap) in float32; logits unchanged without a cap. [..., V] -> [..., V]"""
    if softcap is None:
        return logits
    return softcap * mx.tanh(logits.astype(mx.float32) / softcap)


def linear_head_logprobs(hidden: mx.array, weight: mx.array, targets: mx.array, temperature: float,
                         chunk: int, softcap: float | None = None) -> mx.array:
    """log softmax(z)[targets] with z = u / temperature, u = hidden @ weight.T, or z = cap * tanh(u / cap)
    / temperature with a soft cap; chunk by chunk, with a hand-written backward pass.
    hidden [M, D], weight [V, D], targets [M] -> [M], or targets [M, K] -> [M, K] (K tokens per position:
    the sampled one and a teacher's top-k, read off the same chunk of logits).

    Each chunk's logits are recomputed in the backward pass and fully consumed (both gradients) before
    the next chunk starts (mx.depends orders them), so at most one chunk of [chunk, V] logits exists,
    forward or backward. Autograd over separate chunks would keep every chunk's probabilities alive
    until the hidden-state gradient is assembled."""
    M, several = hidden.shape[0], targets.ndim == 2
    bounds = [(i, min(M, i + chunk)) for i in range(0, M, chunk)]

    def chunk_logits(h, w):
        """z [C, V], and tanh(u / cap) [C, V] for the backward pass (None without a cap)."""
        u = (h @ w.T).astype(mx.float32)  # [C, V]
        if softcap is None:
            return u / temperature, None
        t = mx.tanh(u / softcap)  # [C, V]
        return t * (softcap / temperature), t

    @mx.custom_function
    def head(h, w):
        parts, previous = [], None
        for lo, hi in bounds:
            h_i = h[lo:hi] if previous is None else mx.depends(h[lo:hi], previous)
            z, _ = chunk_logits(h_i, w)
            previous = picked_logprobs(z, targets[lo:hi], several)  # [C] or [C, K]
            parts.append(previous)
        return mx.concatenate(parts)

    @head.vjp
    def head_vjp(primals, cotangent, output):
        h, w = primals
        d_h, d_w, previous = [], mx.zeros(w.shape, dtype=mx.float32), None
        for lo, hi in bounds:
            h_i = h[lo:hi] if previous is None else mx.depends(h[lo:hi], previous)
            z, t = chunk_logits(h_i, w)
            # d lp / d u = (onehot(target) - softmax(z)) / T, scaled by the cotangent of lp
            probs = mx.softmax(z, axis=-1)  # [C, V]
            if several:  # sum_k c_k (onehot(target_k) - softmax(z)) / T; a token listed twice adds twice
                c = cotangent[lo:hi].astype(mx.float32)  # [C, K]
                hits = mx.zeros_like(z).at[mx.arange(hi - lo)[:, None], targets[lo:hi]].add(c)  # [C, V]
                g = (hits - probs * c.sum(axis=-1, keepdims=True)) / temperature  # [C, V]
            else:
                onehot = mx.arange(z.shape[-1])[None, :] == targets[lo:hi, None]
                g = (onehot.astype(mx.float32) - probs) * (cotangent[lo:hi, None] / temperature)  # [C, V]
            if t is not None:  # chain rule through the cap: d(cap * tanh(u / cap)) / du = 1 - tanh^2
                g = g * (1 - t * t)
            g = g.astype(w.dtype)
            d_h.append(g @ w)  # [C, D]
            d_w = d_w + (g.T @ h_i).astype(mx.float32)  # [V, D]
            previous = [d_h[-1], d_w]
        return mx.concatenate(d_h).astype(h.dtype), d_w.astype(w.dtype)

    return head(hidden, weight)


def head_logprobs(model: nn.Module, hidden: mx.array, targets: mx.array, temperature: float,
                  chunk_tokens: int | None = None, softcap: float | None = None) -> mx.array:
    """Log-probs of targets under the model's output head applied to hidden (then the soft cap, if
    any), in token chunks. hidden [n, T, D], targets [n, T] -> [n, T], or [n, T, K] -> [n, T, K]."""
    n, T, D = hidden.shape
    module, project = output_head(model)
    vocab = module.weight.shape[0]
    chunk = chunk_tokens or max(1, LOGIT_CHUNK_ELEMENTS // vocab)
    several, per = targets.ndim == 3, targets.shape[2:]  # K targets per position (per = (K,)), or one
    flat_h, flat_t = hidden.reshape(n * T, D), targets.reshape(n * T, *per)  # [n*T, D], [n*T(, K)]
    if n * T <= chunk:
        return token_logprobs(soft_capped(project(flat_h), softcap), flat_t, temperature, several).reshape(n, T, *per)
    if isinstance(module, (nn.Linear, nn.Embedding)) and "bias" not in module:
        return linear_head_logprobs(flat_h, module.weight, flat_t, temperature, chunk, softcap).reshape(n, T, *per)
    # Other heads (quantized: rollout copies, QLoRA bases; frozen) are projected chunk by chunk by autograd.
    parts = [token_logprobs(soft_capped(project(flat_h[i:i + chunk]), softcap), flat_t[i:i + chunk],
                            temperature, several) for i in range(0, n * T, chunk)]
    return mx.concatenate(parts).reshape(n, T, *per)


class _Checkpointed(nn.Module):
    """A layer whose activations are recomputed in the backward pass (nn.utils.checkpoint: over its trainable
    parameters and its call's arguments), whatever the layer's call signature and outputs."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def __getattr__(self, key):  # the model's forward reads layer attributes (use_sliding, is_linear, ...)
        if key != "layer" and "layer" in self:
            return getattr(self["layer"], key)
        return super().__getattr__(key)

    def __call__(self, *args, **kwargs):
        layer = self.layer

        def bounded(*args, **kwargs):
            with bounded_scan(layer):  # the recomputation runs in the backward pass, outside the forward's scope
                return layer(*args, **kwargs)

        return nn.utils.checkpoint(layer, bounded)(*args, **kwargs)


def _layers_attribute(inner: nn.Module) -> str | None:
    """The inner model's attribute holding its list of transformer layers (nanochat: h)."""
    for name in ("layers", "h"):
        if isinstance(getattr(inner, name, None), list):
            return name
    return None


def supports_layer_checkpointing(model: nn.Module) -> bool:
    """Whether checkpoint_layers has an effect for this model (the trainer warns when it has none)."""
    split = logit_split(model)
    return split is not None and _layers_attribute(split.inner) is not None


def hidden_states(inner: nn.Module, inputs: mx.array, checkpoint_layers: bool = False) -> mx.array:
    """The inner model's final hidden states [n, L, D]. With checkpoint_layers each transformer layer is
    recomputed in the backward pass, so training keeps only the layers' inputs, not their activations:
    the layers are wrapped for the duration of this forward and put back after it (the recomputation
    holds its own reference to each layer)."""
    name = _layers_attribute(inner) if checkpoint_layers else None
    if name is None:
        return inner(inputs)
    layers = getattr(inner, name)
    setattr(inner, name, [_Checkpointed(layer) for layer in layers])
    try:
        return inner(inputs)
    finally:
        setattr(inner, name, layers)


def completion_hidden(split: ResolvedSplit, batch: PackedBatch, checkpoint_layers: bool = False) -> mx.array:
    """The final hidden states [n, T, D] at the positions whose logits predict the completion tokens: what the
    output head sees, for the families in LOGIT_SPLITS (the other [n, L - T] positions skip the head)."""
    hidden = hidden_states(split.inner, batch.inputs, checkpoint_layers)  # [n, L, D]
    idx = mx.broadcast_to(batch.positions[..., None], (*batch.positions.shape, hidden.shape[-1]))
    return mx.take_along_axis(hidden, idx, axis=1)


def completion_logprobs(model: nn.Module, batch: PackedBatch, temperature: float,
                        chunk_tokens: int | None = None, checkpoint_layers: bool = False,
                        extra: mx.array | None = None):
    """Log-probs [n, T] of the completion tokens. For the families in LOGIT_SPLITS only the T completion
    positions go through the output head, in chunks, so [n, L, V] logits never exist. Gated-delta layers
    (Qwen3.5, Qwen3-Next) run models/gated_delta.py's chunked form, whose backward keeps O(L) values, not L states.
    extra [n, T, k] token ids (distill_topk: a teacher's top-k at each position): -> (log-probs [n, T], log-probs
    [n, T, k] of the extra ids), read off the same chunk of logits as the sampled token's, nothing more kept."""
    if extra is not None:
        several = mx.concatenate([batch.targets[..., None], extra.astype(mx.int32)], axis=-1)  # [n, T, 1 + k]
        lp = completion_logprobs(model, PackedBatch(batch.inputs, batch.positions, several, batch.mask),
                                 temperature, chunk_tokens, checkpoint_layers)
        return lp[..., 0], lp[..., 1:]
    with bounded_scan(model):
        split = logit_split(model)
        if split is not None:
            picked = completion_hidden(split, batch, checkpoint_layers)  # [n, T, D]
            # dividing the (capped) logits by d then by the temperature is one division by d * temperature
            scale = temperature * (split.divide or 1.0)
            return head_logprobs(split.outer, picked, batch.targets, scale, chunk_tokens, split.softcap)  # [n, T]
        full = model(batch.inputs)  # [n, L, V]
        logits = mx.take_along_axis(full, batch.positions[..., None], axis=1)
        return token_logprobs(logits, batch.targets, temperature, batch.targets.ndim == 3)  # [n, T(, K)]


def completion_topk(model: nn.Module, batch: PackedBatch, temperature: float, k: int,
                    chunk_tokens: int | None = None, tokens: int | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """A teacher's side of distill_topk, without gradients: log-probs [n, T] of the completion tokens and, at each
    completion position, its k most likely tokens' log-probs [n, T, k] (descending) and ids [n, T, k] (int32),
    under logits / temperature. The output head runs chunk by chunk, each chunk evaluated before the next, so at
    most one chunk of [chunk, V] logits exists, as in completion_logprobs. tokens: the top k is chosen among ids
    below it (the tokenizer's: a teacher's head padded past its vocabulary has rows the student's may lack)."""
    with bounded_scan(model):
        split = logit_split(model)
        if split is not None:
            picked = completion_hidden(split, batch)  # [n, T, D]
            module, project = output_head(split.outer)
            rows, scale = picked.reshape(-1, picked.shape[-1]), temperature * (split.divide or 1.0)
            vocab = module.weight.shape[0]
            logits = lambda lo, hi: soft_capped(project(rows[lo:hi]), split.softcap)  # noqa: E731
        else:
            full = model(batch.inputs)  # [n, L, V]
            rows = mx.take_along_axis(full, batch.positions[..., None], axis=1).reshape(-1, full.shape[-1])
            scale, logits, vocab = temperature, lambda lo, hi: rows[lo:hi], full.shape[-1]  # noqa: E731
        n, T = batch.targets.shape
        flat_t = batch.targets.reshape(-1)
        chunk = chunk_tokens or max(1, LOGIT_CHUNK_ELEMENTS // vocab)
        lps, tops, ids = [], [], []
        for lo in range(0, n * T, chunk):
            hi = min(n * T, lo + chunk)
            z = mx.stop_gradient(logits(lo, hi)).astype(mx.float32) / scale  # [C, V]
            lse = mx.logsumexp(z, axis=-1, keepdims=True)  # [C, 1]
            top = mx.argpartition(-z[:, :tokens], kth=k - 1, axis=-1)[:, :k]  # [C, k], in no order
            values = mx.take_along_axis(z, top, axis=-1) - lse  # [C, k]
            order = mx.argsort(-values, axis=-1)  # descending: the same order whatever argpartition left
            lps.append(mx.take_along_axis(z, flat_t[lo:hi, None], axis=-1).squeeze(-1) - lse.squeeze(-1))
            tops.append(mx.take_along_axis(values, order, axis=-1))
            ids.append(mx.take_along_axis(top, order, axis=-1).astype(mx.int32))
            mx.eval(lps[-1], tops[-1], ids[-1])  # one chunk's logits at a time
        return (mx.concatenate(lps).reshape(n, T), mx.concatenate(tops).reshape(n, T, k),
                mx.concatenate(ids).reshape(n, T, k))
