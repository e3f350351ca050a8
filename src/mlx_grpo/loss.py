"""The GRPO objective as pure array functions: advantages, token log-probs, the clipped loss with KL.

Notation: N = B*G sequences (B prompts, G completions each), T completion tokens, V vocabulary.
Log-probs are taken under logits / temperature, the distribution the sampler drew from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

ADV_EPS = 1e-4
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def group_advantages(rewards: mx.array, group_size: int, scale: str = "group") -> mx.array:
    """A = (r - mean_group) / s with s = std_group + 1e-4 (scale="group"), std_batch + 1e-4 ("batch") or
    1 ("none"); a group whose rewards are all equal gets A = 0 in every mode.

    std is the sample standard deviation (ddof=1), as in TRL and DeepSeekMath's reference code.
    """
    grouped = rewards.astype(mx.float32).reshape(-1, group_size)  # [B, G]
    mean = grouped.mean(axis=1, keepdims=True)  # [B, 1]
    centered = grouped - mean  # [B, G]
    if scale == "group":
        denom = mx.sqrt((centered ** 2).sum(axis=1, keepdims=True) / (group_size - 1)) + ADV_EPS  # [B, 1]
    elif scale == "batch":
        flat_all = grouped.reshape(-1)  # [B*G]
        denom = mx.sqrt(((flat_all - flat_all.mean()) ** 2).sum() / max(flat_all.size - 1, 1)) + ADV_EPS  # []
    elif scale == "none":
        denom = mx.array(1.0)
    else:
        raise ValueError(f"unknown scale_rewards {scale!r}")
    flat = grouped.max(axis=1, keepdims=True) == grouped.min(axis=1, keepdims=True)  # [B, 1]
    adv = mx.where(flat, 0.0, centered / denom)  # [B, G]
    return adv.reshape(-1)  # [N]


def token_logprobs(logits: mx.array, tokens: mx.array, temperature: float) -> mx.array:
    """log softmax(logits / temperature)[token], in float32. logits [..., V], tokens [...] -> [...]."""
    scaled = logits.astype(mx.float32) / temperature  # [..., V]
    picked = mx.take_along_axis(scaled, tokens[..., None], axis=-1).squeeze(-1)  # [...]
    return picked - mx.logsumexp(scaled, axis=-1)  # [...]


@dataclass(frozen=True)
class Objective:
    """The clipped surrogate's settings (config.py documents each and cites its paper)."""

    clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2
    delta: float = 0.0  # > 0: ratios of negative-advantage tokens also capped at delta
    sequence_level: bool = False  # GSPO: one length-normalised ratio per sequence
    kl_coeff: float = 0.0
    kl_estimator: str = "k3"
    rollout_correction: str = "none"  # TIS on the sampler ratio: none, {token,sequence}_{truncate,mask}
    rollout_cap: float = 2.0

    @classmethod
    def from_config(cls, cfg) -> "Objective":
        return cls(clip_low=cfg.clip_eps, clip_high=cfg.clip_eps_high or cfg.clip_eps, delta=cfg.delta,
                   sequence_level=cfg.importance_sampling_level == "sequence", kl_coeff=cfg.kl_coeff,
                   kl_estimator=cfg.kl_estimator, rollout_correction=cfg.rollout_correction,
                   rollout_cap=cfg.rollout_correction_cap)


@dataclass
class LossTerms:
    """Per-token pieces of the objective, for the loss and for logging. All [N, T]."""

    loss: mx.array
    kl: mx.array
    ratio: mx.array
    clipped_low: mx.array  # 1 where the ratio is clipped from below (A < 0): no gradient
    clipped_high: mx.array  # 1 where it is clipped from above (A > 0, or A < 0 past delta)
    is_weight: mx.array  # the rollout-correction weight of each token's policy term (1 when off)
    is_capped: mx.array  # 1 where the sampler ratio exceeds the cap (truncated or masked)


def sampler_weights(old_logp: mx.array, sampler_logp: mx.array, mask: mx.array, mode: str,
                    cap: float) -> tuple[mx.array, mx.array]:
    """Truncated importance sampling on the sampler ratio (TIS; TRL's vllm_importance_sampling_mode):
    r = exp(old - sampler) per token, or exp(sum over the completion of old - sampler) per sequence;
    truncate: w = min(r, cap); mask: w = r, or 0 where r > cap. old is the trainer's log-prob of the
    behaviour policy, sampler the rollout engine's. -> (w, r > cap), each [N, T], without gradient."""
    diff = (old_logp - sampler_logp) * mask  # [N, T]
    if mode.startswith("sequence"):
        diff = mx.broadcast_to(diff.sum(axis=1, keepdims=True), diff.shape)  # [N, T]
    ratio = mx.exp(mx.minimum(diff, 80.0))  # 80: exp stays finite; anything that large is capped anyway
    over = ratio > cap
    weight = mx.minimum(ratio, cap) if mode.endswith("truncate") else mx.where(over, 0.0, ratio)
    return mx.stop_gradient(weight), over.astype(mx.float32)


def masked_sequence_mean(values: mx.array, mask: mx.array) -> mx.array:
    """Each sequence's mean over its masked tokens. values, mask [N, T] -> [N]."""
    return (values * mask).sum(axis=1) / mx.maximum(mask.sum(axis=1), 1.0)


def token_terms(logp: mx.array, old_logp: mx.array, ref_logp: mx.array | None, advantages: mx.array,
                mask: mx.array, obj: Objective, sampler_logp: mx.array | None = None) -> LossTerms:
    """rho = exp(logp - old) per token, or exp(masked mean of logp - old) per sequence (GSPO);
    pg = min(min(rho, delta) * A, clip(rho, 1 - eps_low, 1 + eps_high) * A) (the delta cap only with delta);
    kl = k3: exp(ref - logp) - (ref - logp) - 1, k1: logp - ref; loss_t = -(w * pg - kl_coeff * kl), with w
    the rollout-correction weight (sampler_weights; 1 when off), applied to the policy term as TRL does.
    logp/old_logp/ref_logp/sampler_logp/mask [N, T], advantages [N]."""
    adv = advantages[:, None]  # [N, 1]
    log_ratio = logp - old_logp  # [N, T]
    if obj.sequence_level:
        log_ratio = masked_sequence_mean(log_ratio, mask)[:, None]  # [N, 1]
    ratio = mx.broadcast_to(mx.exp(log_ratio), logp.shape)  # [N, T]
    clipped_ratio = mx.clip(ratio, 1 - obj.clip_low, 1 + obj.clip_high)
    capped = mx.minimum(ratio, obj.delta) if obj.delta > 0 else ratio
    pg = mx.minimum(capped * adv, clipped_ratio * adv)  # [N, T]
    if ref_logp is None:
        kl = mx.zeros_like(logp)
    elif obj.kl_estimator == "k1":
        kl = logp - ref_logp
    else:
        delta = ref_logp - logp
        kl = mx.exp(delta) - delta - 1  # [N, T], >= 0
    low = (ratio < 1 - obj.clip_low) & (adv < 0)
    high = (ratio > 1 + obj.clip_high) & (adv > 0)
    if obj.delta > 0:
        high = high | ((ratio > obj.delta) & (adv < 0))
    # Off: weight 1 and no capped token, written as expressions of logp: mx.compile fails on two outputs
    # that are the same constant (this zero and the KL's when there is no reference).
    weight, capped = mx.ones_like(logp), 0.0 * logp
    if obj.rollout_correction != "none" and sampler_logp is not None:
        weight, capped = sampler_weights(old_logp, sampler_logp, mask, obj.rollout_correction, obj.rollout_cap)
    return LossTerms(loss=-(weight * pg - obj.kl_coeff * kl), kl=kl, ratio=ratio,
                     clipped_low=low.astype(mx.float32), clipped_high=high.astype(mx.float32),
                     is_weight=weight, is_capped=capped)


def row_scales(lengths: list[np.ndarray], keep: list[np.ndarray], loss_type: str,
               max_new_tokens: int) -> list[np.ndarray]:
    """Weight of each row's summed token loss in one update's loss, for each of its batch steps.

    lengths[s] [N_s] completion tokens per row of batch step s; keep[s] [N_s] rows that enter the loss
    (mask_truncated_completions drops some). The update's loss is sum_s sum_i w_si * sum_t loss_sit:
      grpo     w = 1 / (len_i * N)              N rows of the update (dropped rows count, as in TRL)
      bnpo     w = 1 / (tokens_s * S)           tokens of kept rows of step s; S steps with any
      dr_grpo  w = 1 / (N * max_new_tokens)
      dapo     w = 1 / tokens                   tokens of kept rows of the whole update
    Known before any gradient pass, so micro-batches and accumulation steps add up to the exact loss."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    rows = sum(len(x) for x in lengths)
    kept_tokens = [float((np.asarray(n) * k).sum()) for n, k in zip(lengths, keep)]
    steps_with_tokens = sum(t > 0 for t in kept_tokens)
    out = []
    for n, k, tokens_s in zip(lengths, keep, kept_tokens):
        n = np.asarray(n, dtype=np.float64)
        if loss_type == "grpo":
            w = 1.0 / (np.maximum(n, 1.0) * rows)
        elif loss_type == "bnpo":
            w = np.full(n.shape, 1.0 / (tokens_s * steps_with_tokens) if tokens_s else 0.0)
        elif loss_type == "dr_grpo":
            w = np.full(n.shape, 1.0 / (rows * max_new_tokens))
        else:
            total = sum(kept_tokens)
            w = np.full(n.shape, 1.0 / total if total else 0.0)
        out.append((w * np.asarray(k, dtype=np.float64)).astype(np.float32))
    return out


class LossSums(NamedTuple):
    """Sums over one micro-batch, added up across micro-batches: the weighted loss and, over the kept
    tokens (row weight > 0), the token count and sums for the logged means and extrema. The sampler_*
    fields measure the sampler/trainer mismatch: k3 KL(sampler || trainer) and the largest |log-prob
    difference| of a sampled token; is_* the rollout-correction weights and how many tokens passed the cap."""

    loss: mx.array
    tokens: mx.array
    kl: mx.array
    clipped_low: mx.array
    clipped_high: mx.array
    ratio: mx.array
    ratio_min: mx.array
    ratio_max: mx.array
    sampler_kl: mx.array
    sampler_diff_max: mx.array
    is_weight: mx.array
    is_capped: mx.array


# How LossSums fields combine across micro-batches and ranks; every other field is a sum.
SUM_MIN = frozenset({"ratio_min"})
SUM_MAX = frozenset({"ratio_max", "sampler_diff_max"})


def combine_sums(a: LossSums, b: LossSums) -> LossSums:
    """The LossSums of two disjoint sets of rows."""
    return LossSums(*(mx.minimum(x, y) if name in SUM_MIN else mx.maximum(x, y) if name in SUM_MAX else x + y
                      for name, x, y in zip(LossSums._fields, a, b)))


def empty_sums() -> LossSums:
    """The LossSums of no rows: the neutral element of combine_sums."""
    return LossSums(*(mx.array(mx.inf if name in SUM_MIN else -mx.inf if name in SUM_MAX else 0.0)
                      for name in LossSums._fields))


def objective_sums(logp, old_logp, ref_logp, advantages, mask, weights, obj: Objective,
                   sampler_logp=None) -> LossSums:
    """sum_i weights_i * sum_t mask_it * loss_it for one micro-batch, plus logging sums.
    logp/old_logp/ref_logp/sampler_logp/mask [n, T], advantages/weights [n] (row_scales). sampler_logp:
    the rollout engine's log-probs of the sampled tokens (None: the mismatch is not measured)."""
    # Zero the padded positions before the exponentials: exp(garbage) there could overflow to inf,
    # and inf * 0 = NaN would poison the loss and every gradient.
    valid = mask > 0
    logp = mx.where(valid, logp, 0.0)
    old_logp = mx.where(valid, old_logp, 0.0)
    ref_logp = None if ref_logp is None else mx.where(valid, ref_logp, 0.0)
    sampler_logp = None if sampler_logp is None else mx.where(valid, sampler_logp, 0.0)
    terms = token_terms(logp, old_logp, ref_logp, advantages, mask, obj, sampler_logp)
    loss = ((terms.loss * mask).sum(axis=1) * weights).sum()
    kept = mask * (weights > 0)[:, None]  # [n, T]
    present = kept > 0
    if sampler_logp is None:
        sampler_kl, diff_max = mx.array(0.0), mx.array(-mx.inf)
    else:  # tokens drawn from the sampler: k3 = exp(t - s) - (t - s) - 1 estimates KL(sampler || trainer)
        d = mx.stop_gradient(old_logp) - sampler_logp
        # expm1(d) - d keeps small differences (exp(d) - 1 - d cancels to 0 below ~1e-3 in float32);
        # the clamp keeps a wild token finite; >= 0 up to rounding
        dc = mx.clip(d, -20.0, 20.0)
        sampler_kl = (mx.maximum(mx.expm1(dc) - dc, 0.0) * kept).sum()
        diff_max = mx.where(present, mx.abs(d), -mx.inf).max()
    return LossSums(loss=loss, tokens=kept.sum(), kl=(terms.kl * kept).sum(),
                    clipped_low=(terms.clipped_low * kept).sum(), clipped_high=(terms.clipped_high * kept).sum(),
                    ratio=(terms.ratio * kept).sum(), ratio_min=mx.where(present, terms.ratio, mx.inf).min(),
                    ratio_max=mx.where(present, terms.ratio, -mx.inf).max(), sampler_kl=sampler_kl,
                    sampler_diff_max=diff_max, is_weight=(terms.is_weight * kept).sum(),
                    is_capped=(terms.is_capped * kept).sum())


# ----------------------------------------------------------------------------- model passes

@dataclass
class PackedBatch:
    """Prompt + completion rows, right-padded, with where each completion token's logit sits.

    inputs [n, L] token ids; positions [n, T] index of the logit that predicts completion token t;
    targets [n, T] the sampled completion ids; mask [n, T] 1 for real completion tokens.
    """

    inputs: mx.array
    positions: mx.array
    targets: mx.array
    mask: mx.array


# Sequence lengths are rounded up to a multiple of this: the GPU backend builds (and caches) kernels and
# attention plans per shape, and a new plan for every micro-batch costs more than the padding.
SHAPE_BUCKET = 64


def bucket(length: int) -> int:
    return -(-length // SHAPE_BUCKET) * SHAPE_BUCKET


def packed_width(widest_prompt: int, completion_width: int) -> int:
    """Columns of a packed batch: the widest prompt plus the completion width, bucketed."""
    return bucket(widest_prompt + completion_width)


def pack(prompts: list[list[int]], completions: mx.array, mask: mx.array, pad_id: int) -> PackedBatch:
    """Right-pad each prompt+completion row; padding sits after every real token, so a causal model
    gives the real tokens exactly the logits they would get unpadded. prompts: one per row."""
    n, T = completions.shape
    lengths = [len(p) for p in prompts]
    width = packed_width(max(lengths), T)
    rows = []
    comp = completions.tolist()
    for prompt, completion in zip(prompts, comp):
        row = prompt + completion
        rows.append(row + [pad_id] * (width - len(row)))
    inputs = mx.array(rows, dtype=mx.int32)  # [n, L]
    positions = mx.array(lengths, dtype=mx.int32)[:, None] - 1 + mx.arange(T, dtype=mx.int32)[None]  # [n, T]
    return PackedBatch(inputs, positions, completions.astype(mx.int32), mask.astype(mx.float32))


class LogitSplit(NamedTuple):
    """How a model family computes its logits: u = head(inner(inputs)), then logits = cap * tanh(u / cap)
    when softcap is set, else u. The head is _head(model): the untied lm_head, else the tied embedding."""

    inner: str  # attribute holding the inner model: inputs [n, L] -> final hidden states [n, L, D]
    softcap: float | None


# mlx-lm's nanochat applies `softcap(logits)` with its default cap=15.0 (mlx_lm/models/nanochat.py); the
# cap is neither a config field nor a module attribute there, so it is restated here.
NANOCHAT_SOFTCAP = 15.0

# The model families whose logits completion_logprobs computes from hidden states at the completion
# positions only (llama/mistral/qwen2/qwen3: exactly head(model.model(x)), no cap or scaling after it);
# any other model_type takes the full-logits path, model(inputs).
LOGIT_SPLITS = {
    **{kind: LogitSplit("model", None) for kind in ("llama", "mistral", "qwen2", "qwen3")},
    "nanochat": LogitSplit("transformer", NANOCHAT_SOFTCAP),  # untied lm_head
}


# Tokens per output-head chunk are chosen so one chunk's float32 logits stay near this many elements
# (2^25 floats = 128 MB): memory for log-probs is then bounded whatever the batch or vocabulary size.
LOGIT_CHUNK_ELEMENTS = 2 ** 25


def _head(model: nn.Module) -> tuple[nn.Module, callable]:
    """The output head as (module owning its weights, function hidden [..., D] -> logits [..., V])."""
    if hasattr(model, "lm_head"):
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
    hidden [M, D], weight [V, D], targets [M] -> [M].

    Each chunk's logits are recomputed in the backward pass and fully consumed (both gradients) before
    the next chunk starts (mx.depends orders them), so at most one chunk of [chunk, V] logits exists,
    forward or backward. Autograd over separate chunks would keep every chunk's probabilities alive
    until the hidden-state gradient is assembled."""
    M = hidden.shape[0]
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
            picked = mx.take_along_axis(z, targets[lo:hi, None], axis=-1).squeeze(-1)
            previous = picked - mx.logsumexp(z, axis=-1)  # [C]
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
    any), in token chunks. hidden [n, T, D], targets [n, T] -> [n, T]."""
    n, T, D = hidden.shape
    module, project = _head(model)
    vocab = module.weight.shape[0]
    chunk = chunk_tokens or max(1, LOGIT_CHUNK_ELEMENTS // vocab)
    flat_h, flat_t = hidden.reshape(n * T, D), targets.reshape(n * T)  # [n*T, D], [n*T]
    if n * T <= chunk:
        return token_logprobs(soft_capped(project(flat_h), softcap), flat_t, temperature).reshape(n, T)
    if isinstance(module, (nn.Linear, nn.Embedding)) and "bias" not in module:
        return linear_head_logprobs(flat_h, module.weight, flat_t, temperature, chunk, softcap).reshape(n, T)
    # Other heads (quantized: rollout copies, QLoRA bases; frozen) are projected chunk by chunk by autograd.
    parts = [token_logprobs(soft_capped(project(flat_h[i:i + chunk]), softcap), flat_t[i:i + chunk],
                            temperature) for i in range(0, n * T, chunk)]
    return mx.concatenate(parts).reshape(n, T)


def _layer_stack(inner: nn.Module):
    """(embed, layers, final norm) of an inner model whose layers take (x, mask, cache) under full causal
    attention, so each layer can be recomputed alone; None for other shapes (sliding windows, ...)."""
    if all(hasattr(inner, name) for name in ("embed_tokens", "layers", "norm")):
        if any(getattr(layer, "use_sliding", False) for layer in inner.layers):
            return None
        return inner.embed_tokens, inner.layers, inner.norm
    if all(hasattr(inner, name) for name in ("wte", "h")):  # nanochat: weightless norms after the embedding
        from mlx_lm.models.nanochat import rms_norm

        return (lambda x: rms_norm(inner.wte(x))), inner.h, rms_norm
    return None


def supports_layer_checkpointing(model: nn.Module) -> bool:
    """Whether checkpoint_layers has an effect for this model (the trainer warns when it has none)."""
    split = LOGIT_SPLITS.get(getattr(model, "model_type", None))
    return split is not None and _layer_stack(getattr(model, split.inner)) is not None


def hidden_states(inner: nn.Module, inputs: mx.array, checkpoint_layers: bool = False) -> mx.array:
    """The inner model's final hidden states [n, L, D]. With checkpoint_layers each transformer layer is
    recomputed in the backward pass, so training keeps only the layers' inputs, not their activations."""
    stack = _layer_stack(inner) if checkpoint_layers else None
    if stack is None:
        return inner(inputs)
    embed, layers, norm = stack
    h = embed(inputs)  # [n, L, D]
    for layer in layers:
        h = nn.utils.checkpoint(layer, lambda x, layer=layer: layer(x, "causal", None))(h)
    return norm(h)


def completion_logprobs(model: nn.Module, batch: PackedBatch, temperature: float,
                        chunk_tokens: int | None = None, checkpoint_layers: bool = False) -> mx.array:
    """Log-probs [n, T] of the completion tokens. For the families in LOGIT_SPLITS only the T completion
    positions go through the output head, in chunks, so [n, L, V] logits never exist."""
    split = LOGIT_SPLITS.get(getattr(model, "model_type", None))
    if split is not None:
        hidden = hidden_states(getattr(model, split.inner), batch.inputs, checkpoint_layers)  # [n, L, D]
        idx = mx.broadcast_to(batch.positions[..., None], (*batch.positions.shape, hidden.shape[-1]))
        picked = mx.take_along_axis(hidden, idx, axis=1)  # [n, T, D]
        return head_logprobs(model, picked, batch.targets, temperature, chunk_tokens, split.softcap)  # [n, T]
    full = model(batch.inputs)  # [n, L, V]
    logits = mx.take_along_axis(full, batch.positions[..., None], axis=1)
    return token_logprobs(logits, batch.targets, temperature)  # [n, T]
