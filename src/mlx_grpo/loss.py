"""The GRPO objective as pure array functions: advantages, the per-token policy terms with KL, the per-row
weights, and LOSSES, the one declaration of each `loss_type` (its policy term and its normalisation).

Notation: N = B*G sequences (B prompts, G completions each), T completion tokens.
Log-probs come in as arrays (models/forward.py computes them under logits / temperature, the
distribution the sampler drew from); nothing here touches a model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx
import numpy as np

ADV_EPS = 1e-4


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


@dataclass(frozen=True)
class Objective:
    """The objective's settings (config.py documents each and cites its paper)."""

    loss_type: str = "grpo"  # a key of LOSSES: the policy term (and, in row_scales, the normalisation)
    clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2
    delta: float = 0.0  # > 0: ratios of negative-advantage tokens also capped at delta
    sequence_level: bool = False  # GSPO: one length-normalised ratio per sequence
    kl_coeff: float = 0.0
    kl_estimator: str = "k3"
    rollout_correction: str = "none"  # TIS on the sampler ratio: none, {token,sequence}_{truncate,mask}
    rollout_cap: float = 2.0
    cispo_cap: float = 5.0  # CISPO: IS weight sg(min(ratio, cispo_cap))
    sapo_temperature_pos: float = 1.0  # SAPO: gate temperature for A > 0
    sapo_temperature_neg: float = 1.05  # ... and for A <= 0
    distill_coeff: float = 0.0  # on-policy distillation: weight of the teacher's per-token signal (distill_advantages)
    topk_coeff: float = 0.0  # distill_topk: weight of the top-k forward KL to the teacher (topk_forward_kl)

    @classmethod
    def from_config(cls, cfg) -> "Objective":
        o = cfg.objective  # the objective reads only its group
        return cls(loss_type=o.loss_type, cispo_cap=o.cispo_cap, sapo_temperature_pos=o.sapo_temperature_pos,
                   sapo_temperature_neg=o.sapo_temperature_neg, clip_low=o.clip_eps,
                   clip_high=o.clip_eps_high or o.clip_eps, delta=o.delta,
                   sequence_level=o.importance_sampling_level == "sequence", kl_coeff=o.kl_coeff,
                   kl_estimator=o.kl_estimator, rollout_correction=o.rollout_correction,
                   rollout_cap=o.rollout_correction_cap, distill_coeff=o.distill_coeff,
                   topk_coeff=o.distill_topk_coeff if o.distill_topk > 0 else 0.0)


@dataclass
class LossTerms:
    """Per-token pieces of the objective, for the loss and for logging. All [N, T]."""

    loss: mx.array
    kl: mx.array
    ratio: mx.array
    clipped_low: mx.array  # 1 where the ratio is clipped from below (A < 0): no gradient
    clipped_high: mx.array  # 1 where it is clipped from above (A > 0, or A < 0 past delta; CISPO: weight capped)
    is_weight: mx.array  # the rollout-correction weight of each token's policy term (1 when off)
    is_capped: mx.array  # 1 where the sampler ratio exceeds the cap (truncated or masked)


# ----------------------------------------------------------------------------- loss types
# A loss type is a per-token policy term (what each token contributes before the rollout-correction weight
# and the KL) and a normalisation (how token losses are averaged into the update's loss, row_scales).


class PolicyTerm(NamedTuple):
    """One loss type's per-token surrogate, to be maximised, and its clip flags. All [N, T]."""

    pg: mx.array
    clipped_low: mx.array
    clipped_high: mx.array


def clipped_surrogate(ratio: mx.array, logp: mx.array, adv: mx.array, obj: Objective) -> PolicyTerm:
    """PPO's clipped surrogate (GRPO, DeepSeekMath arXiv 2402.03300): pg = min(min(rho, delta) * A,
    clip(rho, 1 - eps_low, 1 + eps_high) * A), the delta cap only with delta (INTELLECT-2).
    ratio/logp [N, T], adv [N, 1]."""
    clipped_ratio = mx.clip(ratio, 1 - obj.clip_low, 1 + obj.clip_high)
    capped = mx.minimum(ratio, obj.delta) if obj.delta > 0 else ratio
    low = (ratio < 1 - obj.clip_low) & (adv < 0)
    high = (ratio > 1 + obj.clip_high) & (adv > 0)
    if obj.delta > 0:
        high = high | ((ratio > obj.delta) & (adv < 0))
    return PolicyTerm(mx.minimum(capped * adv, clipped_ratio * adv), low.astype(mx.float32),
                      high.astype(mx.float32))


def cispo_term(ratio: mx.array, logp: mx.array, adv: mx.array, obj: Objective) -> PolicyTerm:
    """CISPO (MiniMax-M1, arXiv 2506.13585; TRL loss_type="cispo"): pg = sg(min(rho, cap)) * A * logp.
    The IS weight is clipped and detached instead of the update, so every token keeps a gradient w * A
    (PPO's clip zeroes it for tokens past the range). Flags: clipped_high where rho > cap (any sign of A)."""
    weight = mx.stop_gradient(mx.minimum(ratio, obj.cispo_cap))
    return PolicyTerm(weight * adv * logp, 0.0 * ratio, (ratio > obj.cispo_cap).astype(mx.float32))


def sapo_term(ratio: mx.array, logp: mx.array, adv: mx.array, obj: Objective) -> PolicyTerm:
    """SAPO (Soft Adaptive Policy Optimization, Qwen, arXiv 2511.20347; TRL loss_type="sapo"):
    pg = (4 / tau) * sigmoid(tau * (rho - 1)) * A, tau = temperature_pos if A > 0 else temperature_neg.
    A soft gate instead of the hard clip: d pg / d rho = 4 s (1 - s) A, which is A at rho = 1 (GRPO's
    on-policy gradient) and decays smoothly off-policy, faster for a larger tau. No hard clip: flags 0."""
    tau = mx.where(adv > 0, obj.sapo_temperature_pos, obj.sapo_temperature_neg)  # [N, 1]
    # distinct expressions for the zero flags: mx.compile fails on two outputs that are one node
    return PolicyTerm(mx.sigmoid(tau * (ratio - 1)) * (4 / tau) * adv, 0.0 * ratio, 0.0 * logp)


class Counts(NamedTuple):
    """What one update's normalisations need (row_scales)."""

    rows: int  # rows of the update (dropped rows count, as in TRL)
    steps_with_tokens: int  # batch steps with any kept token
    tokens: float  # kept tokens of the whole update
    max_new_tokens: int


def per_sequence(n: np.ndarray, tokens_s: float, c: Counts) -> np.ndarray:
    return 1.0 / (np.maximum(n, 1.0) * c.rows)


def per_step_token(n: np.ndarray, tokens_s: float, c: Counts) -> np.ndarray:
    return np.full(n.shape, 1.0 / (tokens_s * c.steps_with_tokens) if tokens_s else 0.0)


def per_constant(n: np.ndarray, tokens_s: float, c: Counts) -> np.ndarray:
    return np.full(n.shape, 1.0 / (c.rows * c.max_new_tokens))


def per_token(n: np.ndarray, tokens_s: float, c: Counts) -> np.ndarray:
    return np.full(n.shape, 1.0 / c.tokens if c.tokens else 0.0)


@dataclass(frozen=True)
class LossType:
    """One `loss_type`: its per-token policy term and its row weights (w_i below, row_scales). `fields`: the
    config fields only its term reads (validation rejects them changed under another loss type)."""

    term: Callable[[mx.array, mx.array, mx.array, Objective], PolicyTerm]
    norm: Callable[[np.ndarray, float, Counts], np.ndarray]
    fields: tuple[str, ...] = ()


CLIP_FIELDS = ("clip_eps", "clip_eps_high", "delta")
# The one declaration of each loss type. Update loss = sum_i w_i * sum_t loss_it over kept rows i, with
# len_i the row's tokens, N the update's rows, tokens_s the kept tokens of batch step s (S steps with any).
LOSSES: dict[str, LossType] = {
    # clipped surrogate; w = 1 / (len_i * N): mean over each sequence's tokens, then over sequences (DeepSeekMath)
    "grpo": LossType(clipped_surrogate, per_sequence, CLIP_FIELDS),
    # clipped surrogate; w = 1 / (tokens_s * S): token mean per batch step
    "bnpo": LossType(clipped_surrogate, per_step_token, CLIP_FIELDS),
    # clipped surrogate; w = 1 / (N * max_new_tokens): no length bias (Dr. GRPO, Liu et al. 2025)
    "dr_grpo": LossType(clipped_surrogate, per_constant, CLIP_FIELDS),
    # clipped surrogate; w = 1 / tokens: token mean over the whole update (DAPO, Yu et al. 2025)
    "dapo": LossType(clipped_surrogate, per_token, CLIP_FIELDS),
    # sg(min(rho, cispo_cap)) * A * logp, token mean over the update as TRL (CISPO, MiniMax-M1 2025)
    "cispo": LossType(cispo_term, per_token, ("cispo_cap",)),
    # soft temperature gate instead of the clip, per-sequence mean as TRL (SAPO, Qwen 2025)
    "sapo": LossType(sapo_term, per_sequence, ("sapo_temperature_pos", "sapo_temperature_neg")),
}
LOSS_TYPES = tuple(LOSSES)


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


def distill_advantages(advantages: mx.array, old_logp: mx.array, teacher_logp: mx.array, coeff: float) -> mx.array:
    """On-policy distillation (Thinking Machines 2025; TRL's DistillationTrainer): each sampled token's advantage
    is the reward advantage plus coeff times the negated per-token reverse KL estimate on the student's own
    sample, A_it = A_i - coeff * (log pi_old(y_t) - log pi_teacher(y_t)); a teacher that agrees with the
    student adds 0. advantages [N], old_logp/teacher_logp [N, T] -> [N, T], without gradient."""
    return advantages[:, None] + coeff * mx.stop_gradient(teacher_logp - old_logp)


def topk_forward_kl(student_topk: mx.array, teacher_topk: mx.array) -> mx.array:
    """distill_topk's per-token forward KL (GKD, Agarwal et al. 2024, restricted to the teacher's top k):
    sum_i q_i (log q_i - log p_student(i)) over the teacher's k most likely tokens i, with q the teacher's
    distribution renormalised over them, q_i = p_teacher(i) / sum_j p_teacher(j). Renormalised, the value is a
    divergence: >= 0 (it is KL(q || p_student restricted and renormalised) - log of the student's mass on the k
    tokens), 0 exactly when the student's distribution is q; unrenormalised it is a partial sum that can go
    negative, with the same minimiser and each position's gradient scaled by the teacher's mass on its top k.
    At k = vocabulary size both are the full forward KL. student_topk/teacher_topk [n, T, k] log-probs at the
    teacher's top-k ids (the student's with gradient) -> [n, T]."""
    log_q = teacher_topk - mx.logsumexp(teacher_topk, axis=-1, keepdims=True)  # [n, T, k]
    # a token the teacher gives no mass (log q = -inf) adds 0, not 0 * -inf = NaN
    return mx.where(log_q > -mx.inf, mx.exp(log_q) * (log_q - student_topk), 0.0).sum(axis=-1)  # [n, T]


def masked_sequence_mean(values: mx.array, mask: mx.array) -> mx.array:
    """Each sequence's mean over its masked tokens. values, mask [N, T] -> [N]."""
    return (values * mask).sum(axis=1) / mx.maximum(mask.sum(axis=1), 1.0)


def token_terms(logp: mx.array, old_logp: mx.array, ref_logp: mx.array | None, advantages: mx.array,
                mask: mx.array, obj: Objective, sampler_logp: mx.array | None = None,
                sampled: mx.array | None = None) -> LossTerms:
    """rho = exp(logp - old) per token, or exp(masked mean of logp - old) per sequence (GSPO); pg = the loss
    type's policy term (LOSSES[obj.loss_type].term: clipped_surrogate, cispo_term, sapo_term);
    kl = k3: exp(ref - logp) - (ref - logp) - 1, k1: logp - ref; loss_t = -(w * pg - kl_coeff * kl), with w
    the rollout-correction weight (sampler_weights; 1 when off), applied to the policy term as TRL does.
    sampled [N] (None: every row): 1 for sampled rows, 0 for demonstrations (data/demonstrations.py), whose tokens
    no sampler drew: their w is 1, and their old log-probs are the rollout policy's, teacher-forced, so rho
    and the clip are the same PPO ratio as for sampled rows (docs/algorithms-demonstrations.md).
    logp/old_logp/ref_logp/sampler_logp/mask [N, T], advantages [N] (per row) or [N, T] (per token:
    distill_advantages)."""
    adv = advantages[:, None] if advantages.ndim == 1 else advantages  # [N, 1] or [N, T]
    log_ratio = logp - old_logp  # [N, T]
    if obj.sequence_level:
        log_ratio = masked_sequence_mean(log_ratio, mask)[:, None]  # [N, 1]
    ratio = mx.broadcast_to(mx.exp(log_ratio), logp.shape)  # [N, T]
    policy = LOSSES[obj.loss_type].term(ratio, logp, adv, obj)
    if ref_logp is None:
        kl = mx.zeros_like(logp)
    elif obj.kl_estimator == "k1":
        kl = logp - ref_logp
    else:
        delta = ref_logp - logp
        kl = mx.exp(delta) - delta - 1  # [N, T], >= 0
    # Off: weight 1 and no capped token, written as expressions of logp: mx.compile fails on two outputs
    # that are the same constant (this zero and the KL's when there is no reference).
    weight, capped = mx.ones_like(logp), 0.0 * logp
    if obj.rollout_correction != "none" and sampler_logp is not None:
        weight, capped = sampler_weights(old_logp, sampler_logp, mask, obj.rollout_correction, obj.rollout_cap)
        if sampled is not None:  # a demonstration has no sampler log-prob: nothing to correct
            on = sampled[:, None] > 0  # [N, 1]
            weight, capped = mx.where(on, weight, 1.0), mx.where(on, capped, 0.0)
    return LossTerms(loss=-(weight * policy.pg - obj.kl_coeff * kl), kl=kl, ratio=ratio,
                     clipped_low=policy.clipped_low, clipped_high=policy.clipped_high,
                     is_weight=weight, is_capped=capped)


def row_scales(lengths: list[np.ndarray], keep: list[np.ndarray], loss_type: str,
               max_new_tokens: int) -> list[np.ndarray]:
    """Weight of each row's summed token loss in one update's loss, for each of its batch steps: the loss
    type's normalisation (LOSSES[loss_type].norm), zero for rows left out.

    lengths[s] [N_s] completion tokens per row of batch step s; keep[s] [N_s] rows that enter the loss
    (mask_truncated_completions drops some). The update's loss is sum_s sum_i w_si * sum_t loss_sit.
    Known before any gradient pass, so micro-batches and accumulation steps add up to the exact loss."""
    if loss_type not in LOSSES:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    kept_tokens = [float((np.asarray(n) * k).sum()) for n, k in zip(lengths, keep)]
    counts = Counts(rows=sum(len(x) for x in lengths), steps_with_tokens=sum(t > 0 for t in kept_tokens),
                    tokens=sum(kept_tokens), max_new_tokens=max_new_tokens)
    norm = LOSSES[loss_type].norm
    return [(norm(np.asarray(n, dtype=np.float64), tokens_s, counts) * np.asarray(k, dtype=np.float64))
            .astype(np.float32) for n, k, tokens_s in zip(lengths, keep, kept_tokens)]


class LossSums(NamedTuple):
    """Sums over one micro-batch, added up across micro-batches: the weighted loss and, over the kept
    tokens (row weight > 0), the token count and sums for the logged means and extrema. The sampler_*
    fields measure the sampler/trainer mismatch: k3 KL(sampler || trainer) and the largest |log-prob
    difference| of a sampled token; is_* the rollout-correction weights and how many tokens passed the cap;
    all four cover the sampled_tokens (kept tokens of sampled rows: demonstrations have no sampler)."""

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
    sampled_tokens: mx.array
    teacher_kl: mx.array  # on-policy distillation: sum over kept tokens of log pi_old - log pi_teacher
    forward_kl: mx.array  # distill_topk: sum over kept tokens of topk_forward_kl


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
                   sampler_logp=None, sampled=None, teacher_logp=None, topk=None) -> LossSums:
    """sum_i weights_i * sum_t mask_it * loss_it for one micro-batch, plus logging sums.
    logp/old_logp/ref_logp/sampler_logp/teacher_logp/mask [n, T], advantages/weights/sampled [n] (row_scales).
    sampler_logp: the rollout engine's log-probs of the sampled tokens (None: the mismatch is not measured);
    sampled: 0 marks demonstration rows, left out of the sampler mismatch and its correction (None: every row
    sampled); teacher_logp: a teacher's log-probs of the same tokens (on-policy distillation, obj.distill_coeff;
    None: rewards alone); topk: (the student's log-probs [n, T, k] at the teacher's top-k ids, with gradient, and
    the teacher's [n, T, k]) adds obj.topk_coeff * topk_forward_kl per token, weighted as the policy term (None:
    no such term)."""
    # Zero the padded positions before the exponentials: exp(garbage) there could overflow to inf,
    # and inf * 0 = NaN would poison the loss and every gradient.
    valid = mask > 0
    logp = mx.where(valid, logp, 0.0)
    old_logp = mx.where(valid, old_logp, 0.0)
    ref_logp = None if ref_logp is None else mx.where(valid, ref_logp, 0.0)
    sampler_logp = None if sampler_logp is None else mx.where(valid, sampler_logp, 0.0)
    if teacher_logp is not None:
        teacher_logp = mx.where(valid, teacher_logp, 0.0)
        advantages = distill_advantages(advantages, old_logp, teacher_logp, obj.distill_coeff)
    terms = token_terms(logp, old_logp, ref_logp, advantages, mask, obj, sampler_logp, sampled)
    loss = ((terms.loss * mask).sum(axis=1) * weights).sum()
    kept = mask * (weights > 0)[:, None]  # [n, T]
    # not teacher_kl's (0.0 * kept).sum(): mx.compile fails on two outputs that are one node
    forward_kl = (0.0 * mask).sum()
    if topk is not None:  # the same token mask and row weights as the policy term: padding/accumulation invariant
        on = valid[..., None]  # [n, T, 1]
        fkl = topk_forward_kl(mx.where(on, topk[0], 0.0), mx.where(on, topk[1], 0.0))  # [n, T]
        loss = loss + obj.topk_coeff * ((fkl * mask).sum(axis=1) * weights).sum()
        forward_kl = (mx.stop_gradient(fkl) * kept).sum()
    present = kept > 0
    # [n, T] kept tokens a sampler drew; a product even without demonstrations: mx.compile fails on two
    # outputs that are one node, which sampled_tokens and tokens would then be
    drawn = kept * (mx.ones_like(weights) if sampled is None else (sampled > 0).astype(kept.dtype))[:, None]
    if sampler_logp is None:
        sampler_kl, diff_max = mx.array(0.0), mx.array(-mx.inf)
    else:  # tokens drawn from the sampler: k3 = exp(t - s) - (t - s) - 1 estimates KL(sampler || trainer)
        d = mx.stop_gradient(old_logp) - sampler_logp
        # expm1(d) - d keeps small differences (exp(d) - 1 - d cancels to 0 below ~1e-3 in float32);
        # the clamp keeps a wild token finite; >= 0 up to rounding
        dc = mx.clip(d, -20.0, 20.0)
        sampler_kl = (mx.maximum(mx.expm1(dc) - dc, 0.0) * drawn).sum()
        diff_max = mx.where(drawn > 0, mx.abs(d), -mx.inf).max()
    return LossSums(loss=loss, tokens=kept.sum(), kl=(terms.kl * kept).sum(),
                    clipped_low=(terms.clipped_low * kept).sum(), clipped_high=(terms.clipped_high * kept).sum(),
                    ratio=(terms.ratio * kept).sum(), ratio_min=mx.where(present, terms.ratio, mx.inf).min(),
                    ratio_max=mx.where(present, terms.ratio, -mx.inf).max(), sampler_kl=sampler_kl,
                    sampler_diff_max=diff_max, is_weight=(terms.is_weight * drawn).sum(),
                    is_capped=(terms.is_capped * drawn).sum(), sampled_tokens=drawn.sum(),
                    teacher_kl=(0.0 * kept).sum() if teacher_logp is None
                    else (mx.stop_gradient(old_logp - teacher_logp) * kept).sum(), forward_kl=forward_kl)
