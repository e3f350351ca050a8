"""The GRPO objective against naive float64 references written from the spec.

Advantages, the clipped loss with KL and clip fraction, padding invariance, the gradient w.r.t. the
policy log-probs, rollout correction, and the CISPO and SAPO policy terms. The training forward
(log-probs from a model) is in test_forward.py.
"""

from __future__ import annotations

import dataclasses
import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_grpo.loss import (LOSS_TYPES, LOSSES, Objective, group_advantages, objective_sums, row_scales,
                           token_terms)

RTOL = 1e-5
ATOL = 1e-6


# ----------------------------------------------------------------------------- naive references

def naive_advantages(rewards, group_size):
    """GRPO's group-scaled advantages (naive_advantages_scaled below, scale "group")."""
    return naive_advantages_scaled(rewards, group_size, "group")


def naive_token_terms(logp, old, ref, adv, mask, clip_eps, kl_coeff, clip_high=None, delta=0.0,
                      sequence=False, estimator="k3", loss_type="grpo", cispo_cap=5.0, tau_pos=1.0, tau_neg=1.05,
                      weight_logp=None, teacher=None, distill=0.0):
    """Per-token loss, kl, ratio, clipped-low and clipped-high flags as float64 [N, T] from plain loops.
    teacher [N, T] (on-policy distillation): each token's advantage is its row's plus
    distill * (teacher - old), the negated reverse-KL estimate on the sampled token.
    loss_type picks the policy term: the clipped surrogate, cispo (weight min(rho, cap) * A * logp, the weight
    a constant: computed from weight_logp when given, so finite differences see it fixed) or sapo (gate
    4 / tau * sigmoid(tau * (rho - 1)) * A)."""
    hi = clip_eps if clip_high is None else clip_high
    weight_logp = logp if weight_logp is None else weight_logp
    N, T = logp.shape
    loss, kl, ratio, low, high = (np.zeros((N, T)) for _ in range(5))
    for n in range(N):
        a = float(adv[n])
        idx = [t for t in range(T) if mask[n, t] > 0]
        seq = math.exp(sum(float(logp[n, t]) - float(old[n, t]) for t in idx) / max(len(idx), 1))
        seq_w = math.exp(sum(float(weight_logp[n, t]) - float(old[n, t]) for t in idx) / max(len(idx), 1))
        row_a = a
        for t in range(T):
            a = row_a if teacher is None else row_a + distill * (float(teacher[n, t]) - float(old[n, t]))
            lp = float(logp[n, t])
            rho = seq if sequence else math.exp(lp - float(old[n, t]))
            if loss_type == "cispo":
                rho_w = seq_w if sequence else math.exp(float(weight_logp[n, t]) - float(old[n, t]))
                pg = min(rho_w, cispo_cap) * a * lp
            elif loss_type == "sapo":
                tau = tau_pos if a > 0 else tau_neg
                pg = 4 / tau / (1 + math.exp(-tau * (rho - 1))) * a
            else:
                unclipped_term = (min(rho, delta) if delta else rho) * a
                clipped_term = min(max(rho, 1 - clip_eps), 1 + hi) * a
                pg = min(unclipped_term, clipped_term)
            if ref is None:
                k = 0.0
            elif estimator == "k1":
                k = lp - float(ref[n, t])
            else:
                d = float(ref[n, t]) - lp
                k = math.exp(d) - d - 1
            loss[n, t] = -(pg - kl_coeff * k)
            kl[n, t], ratio[n, t] = k, rho
            if loss_type == "cispo":
                high[n, t] = float(rho > cispo_cap)
            elif loss_type != "sapo":
                low[n, t] = float(rho < 1 - clip_eps and a < 0)
                high[n, t] = float((rho > 1 + hi and a > 0) or (delta > 0 and rho > delta and a < 0))
    return loss, kl, ratio, low, high


def naive_loss_sum(logp, old, ref, adv, mask, clip_eps, kl_coeff, **variant):
    """Sum over sequences of each sequence's token-mean loss (the grpo loss times N)."""
    loss = naive_token_terms(logp, old, ref, adv, mask, clip_eps, kl_coeff, **variant)[0]
    total = 0.0
    for n in range(logp.shape[0]):
        idx = [t for t in range(logp.shape[1]) if mask[n, t] > 0]
        total += sum(loss[n, t] for t in idx) / len(idx)
    return total


def naive_update_loss(steps, loss_type, max_new_tokens, clip_eps, kl_coeff, **variant):
    """The update's loss from its definition. steps: [(logp, old, ref, adv, mask, keep)] per batch step;
    rows with keep False are left out (their tokens do not count either)."""
    per_step = []  # (token losses of kept rows, rows in the step)
    for logp, old, ref, adv, mask, keep in steps:
        loss = naive_token_terms(logp, old, ref, adv, mask, clip_eps, kl_coeff, loss_type=loss_type, **variant)[0]
        rows = [[loss[n, t] for t in range(logp.shape[1]) if mask[n, t] > 0] if keep[n] else []
                for n in range(logp.shape[0])]
        per_step.append((rows, logp.shape[0]))
    n_rows = sum(count for _, count in per_step)
    if loss_type in ("grpo", "sapo"):  # TRL normalises sapo as grpo, cispo as dapo
        return sum(sum(r) / len(r) for rows, _ in per_step for r in rows if r) / n_rows
    if loss_type == "bnpo":
        means = [sum(map(sum, rows)) / sum(map(len, rows)) for rows, _ in per_step if sum(map(len, rows))]
        return sum(means) / len(means)
    if loss_type == "dr_grpo":
        return sum(sum(r) for rows, _ in per_step for r in rows) / (n_rows * max_new_tokens)
    assert loss_type in ("dapo", "cispo")
    return (sum(sum(r) for rows, _ in per_step for r in rows)
            / sum(len(r) for rows, _ in per_step for r in rows))


def naive_advantages_scaled(rewards, group_size, scale):
    """(r - group mean) / (std + 1e-4), std of the group or of the whole batch (ddof=1), or no division;
    flat groups 0."""
    r = [float(x) for x in rewards]
    mean_all = sum(r) / len(r)
    std_all = math.sqrt(sum((x - mean_all) ** 2 for x in r) / max(len(r) - 1, 1))
    out = []
    for start in range(0, len(r), group_size):
        group = r[start:start + group_size]
        mean = sum(group) / len(group)
        if all(x == group[0] for x in group):
            out.extend([0.0] * len(group))
        elif scale == "group":
            std = math.sqrt(sum((x - mean) ** 2 for x in group) / (len(group) - 1))
            out.extend([(x - mean) / (std + 1e-4) for x in group])
        elif scale == "batch":
            out.extend([(x - mean) / (std_all + 1e-4) for x in group])
        else:
            out.extend([x - mean for x in group])
    return np.array(out)


def np_(x):
    return np.array(x.astype(mx.float32).tolist(), dtype=np.float64)


# ----------------------------------------------------------------------------- advantages

def test_group_advantages_random_groups_match_naive():
    rng = np.random.default_rng(0)
    for group_size, groups in ((4, 5), (8, 3), (2, 6), (3, 1)):
        rewards = rng.normal(size=groups * group_size).astype(np.float32) * 2.0
        got = group_advantages(mx.array(rewards), group_size)
        assert got.shape == (groups * group_size,)
        assert got.dtype == mx.float32
        np.testing.assert_allclose(np_(got), naive_advantages(rewards, group_size), rtol=RTOL, atol=ATOL)


def test_group_advantages_binary_rewards_match_naive():
    rng = np.random.default_rng(1)
    rewards = rng.integers(0, 2, size=6 * 4).astype(np.float32)  # typical 0/1 correctness rewards
    got = group_advantages(mx.array(rewards), 4)
    np.testing.assert_allclose(np_(got), naive_advantages(rewards, 4), rtol=RTOL, atol=ATOL)


def test_group_advantages_flat_groups_are_exactly_zero():
    rewards = np.array([0, 0, 0, 0,  2.5, 2.5, 2.5, 2.5,  1, 0, 0, 1,  -1.25, -1.25, -1.25, -1.25],
                       dtype=np.float32)
    got = np_(group_advantages(mx.array(rewards), 4))
    assert got.shape == (16,)
    assert np.all(got[0:4] == 0.0) and np.all(got[4:8] == 0.0) and np.all(got[12:16] == 0.0)
    assert not np.any(np.isnan(got))
    np.testing.assert_allclose(got[8:12], naive_advantages(rewards[8:12], 4), rtol=RTOL, atol=ATOL)
    # 0/1 rewards with half right: mean 0.5, sample std sqrt(1/3)
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    np.testing.assert_allclose(got[8:12], [expected, -expected, -expected, expected], rtol=RTOL)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_scale_modes_match_naive(scale):
    rng = np.random.default_rng(6)
    rewards = rng.normal(size=5 * 4).astype(np.float32) * 2.0
    rewards[4:8] = 1.5  # one flat group: 0 in every mode
    got = np_(group_advantages(mx.array(rewards), 4, scale))
    np.testing.assert_allclose(got, naive_advantages_scaled(rewards, 4, scale), rtol=RTOL, atol=ATOL)
    assert np.all(got[4:8] == 0.0)


def test_group_advantages_group_of_two():
    rewards = np.array([1.0, 0.0, 3.0, 3.0, -2.0, 5.0], dtype=np.float32)
    got = np_(group_advantages(mx.array(rewards), 2))
    # G=2: sample std = |r1 - r2| / sqrt(2), so A = +-(d/2) / (|d|/sqrt(2) + 1e-4)
    np.testing.assert_allclose(got, naive_advantages(rewards, 2), rtol=RTOL, atol=ATOL)
    assert got[2] == 0.0 and got[3] == 0.0
    np.testing.assert_allclose(got[0], 0.5 / (1 / math.sqrt(2) + 1e-4), rtol=RTOL)


# ----------------------------------------------------------------------------- loss

def _loss_case(seed=3, N=6, T=7):
    """Random log-probs whose ratios cover both clip sides and the unclipped middle, with
    advantages of both signs (and one zero), and masks of different lengths incl. a 1-token row."""
    rng = np.random.default_rng(seed)
    old = rng.uniform(-4.0, -0.2, size=(N, T))
    log_ratio = rng.choice([-0.6, -0.35, -0.05, 0.0, 0.04, 0.21, 0.3, 0.7], size=(N, T))
    log_ratio += rng.uniform(-0.02, 0.02, size=(N, T))  # stay away from the exact clip edges
    logp = old + log_ratio
    ref = logp + rng.normal(scale=0.3, size=(N, T))
    adv = np.array([1.3, -0.8, 0.6, -1.7, 0.0, 2.1])[:N]
    lengths = [7, 4, 1, 6, 3, 5][:N]
    mask = np.zeros((N, T))
    for n, length in enumerate(lengths):
        mask[n, :length] = 1.0
    f32 = lambda a: a.astype(np.float32)  # noqa: E731
    return f32(logp), f32(old), f32(ref), f32(adv), f32(mask)


def test_loss_case_covers_both_clip_sides():
    logp, old, _, adv, mask = _loss_case()
    rho = np.exp(logp.astype(np.float64) - old)
    eps = 0.2
    real = mask > 0
    a = np.broadcast_to(adv[:, None], rho.shape)
    assert np.any(real & (rho > 1 + eps) & (a > 0))
    assert np.any(real & (rho < 1 - eps) & (a < 0))
    assert np.any(real & (rho > 1 - eps) & (rho < 1 + eps) & (a != 0))
    assert np.any(real & (rho > 1 + eps) & (a < 0))  # outside the range but the unclipped term is active


VARIANTS = {
    "grpo": {},
    "clip_higher": {"clip_high": 0.28},
    "delta": {"delta": 1.5},
    "clip_higher_delta": {"clip_high": 0.28, "delta": 1.4},
    "gspo": {"sequence": True},
    "gspo_clip_higher": {"sequence": True, "clip_high": 0.25},
    "k1": {"estimator": "k1"},
}

# Settings of the two policy terms that are not the clipped surrogate; caps and temperatures that bind on
# _loss_case's ratios (exp of -0.6 .. 0.7).
TERMS = {
    "cispo": {"loss_type": "cispo", "cispo_cap": 1.3},
    "cispo_default_cap": {"loss_type": "cispo"},
    "cispo_gspo": {"loss_type": "cispo", "cispo_cap": 1.05, "sequence": True},
    "sapo": {"loss_type": "sapo"},
    "sapo_hot": {"loss_type": "sapo", "tau_pos": 4.0, "tau_neg": 8.0},
    "sapo_gspo": {"loss_type": "sapo", "tau_pos": 2.0, "tau_neg": 3.0, "sequence": True},
}


def objective(clip_eps=0.2, kl_coeff=0.04, clip_high=None, delta=0.0, sequence=False, estimator="k3",
              loss_type="grpo", cispo_cap=5.0, tau_pos=1.0, tau_neg=1.05, distill=0.0):
    return Objective(clip_low=clip_eps, clip_high=clip_eps if clip_high is None else clip_high, delta=delta,
                     sequence_level=sequence, kl_coeff=kl_coeff, kl_estimator=estimator, loss_type=loss_type,
                     cispo_cap=cispo_cap, sapo_temperature_pos=tau_pos, sapo_temperature_neg=tau_neg,
                     distill_coeff=distill)


def per_sequence_weights(mask):
    """Row weights that make objective_sums the sum of per-sequence token means."""
    return mx.array(1.0 / mask.sum(axis=1))


def loss_sums(logp, old, ref, adv, mask, obj):
    arrays = [None if a is None else mx.array(a) for a in (logp, old, ref, adv, mask)]
    return objective_sums(*arrays, per_sequence_weights(mask), obj)


def test_loss_case_covers_every_clip_region():
    logp, old, _, adv, mask = _loss_case()
    rho = np.exp(logp.astype(np.float64) - old)
    real = mask > 0
    a = np.broadcast_to(adv[:, None], rho.shape)
    assert np.any(real & (rho > 1.28) & (a > 0))  # clipped from above even with clip-higher
    assert np.any(real & (rho > 1.2) & (rho < 1.28) & (a > 0))  # clip-higher changes these
    assert np.any(real & (rho < 0.8) & (a < 0))
    assert np.any(real & (rho > 1 - 0.2) & (rho < 1 + 0.2) & (a != 0))
    assert np.any(real & (rho > 1.5) & (a < 0))  # the delta cap binds
    assert np.any(real & (rho > 1.2) & (rho < 1.4) & (a < 0))  # outside the clip range, below delta


@pytest.mark.parametrize("variant", list(VARIANTS) + list(TERMS))  # TERMS: cispo and sapo
@pytest.mark.parametrize("kl_coeff", [0.0, 0.04])
@pytest.mark.parametrize("with_ref", [True, False])
def test_token_terms_match_naive(variant, kl_coeff, with_ref):
    logp, old, ref, adv, mask = _loss_case()
    ref = ref if with_ref else None
    kw = {**VARIANTS, **TERMS}[variant]
    terms = token_terms(mx.array(logp), mx.array(old), None if ref is None else mx.array(ref), mx.array(adv),
                        mx.array(mask), objective(kl_coeff=kl_coeff, **kw))
    real = mask > 0  # GSPO's ratio is defined from the real tokens; compare there
    expected = naive_token_terms(logp, old, ref, adv, mask, 0.2, kl_coeff, **kw)
    for got, want in zip((terms.loss, terms.kl, terms.ratio, terms.clipped_low, terms.clipped_high), expected):
        np.testing.assert_allclose(np_(got)[real], want[real], rtol=RTOL, atol=ATOL)
    if ref is None:
        assert np.all(np_(terms.kl) == 0.0)


def test_variants_change_the_loss():
    """Each option changes the signal on this case (the naive reference agrees with each, above)."""
    logp, old, ref, adv, mask = _loss_case()
    values = {name: naive_loss_sum(logp, old, ref, adv, mask, 0.2, 0.04, **kw) for name, kw in VARIANTS.items()}
    assert len({round(v, 9) for v in values.values()}) == len(values), values


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("kl_coeff", [0.0, 0.04])
def test_objective_sums_match_naive(variant, kl_coeff):
    logp, old, ref, adv, mask = _loss_case()
    kw = VARIANTS[variant]
    sums = loss_sums(logp, old, ref, adv, mask, objective(kl_coeff=kl_coeff, **kw))
    np.testing.assert_allclose(sums.loss.item(), naive_loss_sum(logp, old, ref, adv, mask, 0.2, kl_coeff, **kw),
                               rtol=RTOL, atol=ATOL)
    _, kl, ratio, low, high = naive_token_terms(logp, old, ref, adv, mask, 0.2, kl_coeff, **kw)
    real = mask > 0
    assert sums.tokens.item() == real.sum()
    for got, want in ((sums.kl, kl), (sums.clipped_low, low), (sums.clipped_high, high), (sums.ratio, ratio)):
        np.testing.assert_allclose(got.item(), want[real].sum(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(sums.ratio_min.item(), ratio[real].min(), rtol=RTOL)
    np.testing.assert_allclose(sums.ratio_max.item(), ratio[real].max(), rtol=RTOL)
    if not kw.get("sequence"):
        assert low[real].sum() > 0 and high[real].sum() > 0


def test_gspo_clips_whole_sequences():
    """With GSPO's small clip range every token of a sequence shares one ratio and one clip decision."""
    logp, old, ref, _, mask = _loss_case()
    obj = Objective(clip_low=0.03, clip_high=0.04, sequence_level=True, kl_coeff=0.04)
    real = mask > 0
    clipped = {"low": 0.0, "high": 0.0}
    for adv in (np.array([1.3, -0.8, 0.6, -1.7, 0.0, 2.1], np.float32), np.array([-1, 1, -1, 1, 1, -1], np.float32)):
        terms = token_terms(*(mx.array(a) for a in (logp, old, ref, adv, mask)), obj)
        _, _, _, low, high = naive_token_terms(logp, old, ref, adv, mask, 0.03, 0.04, clip_high=0.04, sequence=True)
        np.testing.assert_array_equal(np_(terms.clipped_low)[real], low[real])
        np.testing.assert_array_equal(np_(terms.clipped_high)[real], high[real])
        clipped["low"] += low[real].sum()
        clipped["high"] += high[real].sum()
        for n in range(len(adv)):  # one ratio per sequence
            assert np.ptp(np_(terms.ratio)[n][real[n]]) == 0
    assert clipped["low"] > 0 and clipped["high"] > 0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("variant", ["grpo", "clip_higher_delta", "gspo"])
@pytest.mark.parametrize("masked", [False, True])
def test_update_loss_of_each_loss_type_matches_naive(loss_type, variant, masked):
    """Two batch steps of different lengths, split into micro-batches: row_scales + objective_sums add up
    to the loss as each paper defines it; masked rows (truncated) drop out of the sum and the counts."""
    kw = VARIANTS[variant]
    steps = []
    for seed, keep in ((3, [True, False, True, True, False, True]), (5, [True, True, False, True, True, True])):
        logp, old, ref, adv, mask = _loss_case(seed=seed)
        steps.append((logp, old, ref, adv, mask, np.array(keep) if masked else np.ones(6, bool)))
    weights = row_scales([s[4].sum(axis=1) for s in steps], [s[5] for s in steps], loss_type, max_new_tokens=9)
    obj = objective(loss_type=loss_type, **kw)
    total = 0.0
    for (logp, old, ref, adv, mask, _), w in zip(steps, weights):
        for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):
            arrays = [mx.array(a[rows]) for a in (logp, old, ref, adv, mask)]
            total += objective_sums(*arrays, mx.array(w[rows]), obj).loss.item()
    expected = naive_update_loss(steps, loss_type, 9, 0.2, 0.04, **kw)
    np.testing.assert_allclose(total, expected, rtol=RTOL, atol=ATOL)


CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo")  # one policy term, four normalisations


def test_loss_types_differ_and_dapo_is_accumulation_invariant():
    """dapo and dr_grpo weigh every token alike across the update; bnpo per batch step; grpo per sequence."""
    logp, old, ref, adv, mask = _loss_case()
    keep = np.ones(6, bool)
    whole = {t: naive_update_loss([(logp, old, ref, adv, mask, keep)], t, 9, 0.2, 0.04) for t in CLIPPED}
    assert len({round(v, 9) for v in whole.values()}) == 3
    np.testing.assert_allclose(whole["bnpo"], whole["dapo"], rtol=1e-12)  # the same within one batch step
    halves = [tuple(a[rows] for a in (logp, old, ref, adv, mask, keep)) for rows in (slice(0, 3), slice(3, 6))]
    for loss_type in ("dapo", "dr_grpo", "grpo"):  # one step of 6 rows == two steps of 3 rows
        split = naive_update_loss(halves, loss_type, 9, 0.2, 0.04)
        np.testing.assert_allclose(split, whole[loss_type], rtol=1e-12)
    assert abs(naive_update_loss(halves, "bnpo", 9, 0.2, 0.04) - whole["bnpo"]) > 1e-6  # per step, by definition


def test_row_scales_sum_and_zero_for_dropped_rows():
    lengths = [np.array([3, 5, 2]), np.array([4, 1])]
    keep = [np.array([True, False, True]), np.array([True, True])]
    w = row_scales(lengths, keep, "dapo", 8)
    assert w[0][1] == 0 and sum((x * n).sum() for x, n in zip(w, lengths)) == pytest.approx(1.0)
    w = row_scales(lengths, keep, "grpo", 8)
    np.testing.assert_allclose(np.concatenate(w), [1 / 15, 0, 1 / 10, 1 / 20, 1 / 5], rtol=1e-6)
    w = row_scales(lengths, keep, "dr_grpo", 8)
    np.testing.assert_allclose(np.concatenate(w), np.array([1, 0, 1, 1, 1]) / 40, rtol=1e-6)
    w = row_scales(lengths, keep, "bnpo", 8)
    np.testing.assert_allclose(np.concatenate(w), [1 / 10, 0, 1 / 10, 1 / 10, 1 / 10], rtol=1e-6)


def test_first_step_ratio_one_gives_minus_mean_advantage():
    """old = logp (first iteration): rho = 1, nothing clipped, loss per sequence = -A (+ kl term); GSPO too."""
    logp, _, _, adv, mask = _loss_case()
    for sequence in (False, True):
        sums = loss_sums(logp, logp, None, adv, mask, objective(sequence=sequence))
        np.testing.assert_allclose(sums.loss.item(), -float(adv.astype(np.float64).sum()), rtol=RTOL, atol=ATOL)
        assert sums.clipped_low.item() == 0.0 and sums.clipped_high.item() == 0.0 and sums.kl.item() == 0.0
        assert sums.ratio_min.item() == 1.0 and sums.ratio_max.item() == 1.0


def _pad(logp, old, ref, mask, extra, rng, low, high):
    """`extra` padded columns of garbage in [low, high), and garbage log-probs in the masked-out tail of the
    existing rows too (beyond each row's length)."""
    N = logp.shape[0]
    garbage = lambda: rng.uniform(low, high, size=(N, extra)).astype(np.float32)  # noqa: E731
    cat = lambda a, b: np.concatenate([a, b], axis=1)  # noqa: E731
    p_logp, p_old, p_ref = cat(logp, garbage()), cat(old, garbage()), cat(ref, garbage())
    p_mask = cat(mask, np.zeros((N, extra), dtype=np.float32))
    p_logp = np.where(p_mask == 0, rng.uniform(low, high, size=p_logp.shape), p_logp).astype(np.float32)
    return p_logp, p_old, p_ref, p_mask


@pytest.mark.parametrize("variant", ["grpo", "gspo", "clip_higher_delta"])
@pytest.mark.parametrize("kl_coeff", [0.0, 0.04])
def test_padding_with_garbage_does_not_change_loss(variant, kl_coeff):
    logp, old, ref, adv, mask = _loss_case()
    obj = objective(kl_coeff=kl_coeff, **VARIANTS[variant])
    base = loss_sums(logp, old, ref, adv, mask, obj)
    rng = np.random.default_rng(4)
    for extra in (1, 5):  # garbage in the padding and in the masked-out tail of the existing rows
        p_logp, p_old, p_ref, p_mask = _pad(logp, old, ref, mask, extra, rng, -30.0, 5.0)
        padded = loss_sums(p_logp, p_old, p_ref, adv, p_mask, obj)
        for a, b in zip(base, padded):
            np.testing.assert_allclose(b.item(), a.item(), rtol=RTOL, atol=ATOL)


def test_padding_where_model_gives_the_pad_token_a_tiny_logprob():
    """In training, padded positions carry old = ref = 0 (logprob_pass multiplies by the mask) while
    logp there is the model's log-prob of the pad id, which can be below -88.7 for a confident model.
    exp(ref - logp) then overflows float32 to inf, and inf * mask 0 = nan: the masked-out tokens
    must still not change the loss (nor make its gradient nan)."""
    logp, old, ref, adv, mask = _loss_case()
    obj = objective()
    base = loss_sums(logp, old, ref, adv, mask, obj).loss
    N, T = logp.shape
    p_logp = np.concatenate([logp, np.full((N, 2), -100.0, np.float32)], axis=1)
    zeros = np.zeros((N, 2), np.float32)
    p_old, p_ref, p_mask = (np.concatenate([a, zeros], axis=1) for a in (old, ref, mask))
    args = (mx.array(p_old), mx.array(p_ref), mx.array(adv), mx.array(p_mask), per_sequence_weights(p_mask), obj)
    padded = objective_sums(mx.array(p_logp), *args)
    grad = mx.grad(lambda lp: objective_sums(lp, *args).loss)(mx.array(p_logp))
    assert math.isfinite(padded.loss.item()) and math.isfinite(padded.kl.item()), (
        f"masked-out padding with logp=-100, ref=0 turns the loss into {padded.loss.item()}")
    np.testing.assert_allclose(padded.loss.item(), base.item(), rtol=RTOL, atol=ATOL)
    assert np.all(np.isfinite(np_(grad))), "gradient is not finite at masked-out padding"


# ----------------------------------------------------------------------------- gradient

def naive_grad_wrt_logp(logp, old, ref, adv, mask, clip_eps, kl_coeff):
    """d(loss sum)/d logp: only tokens where the unclipped term is active carry the pg gradient
    -rho*A; the k3 KL gives kl_coeff * (1 - exp(ref - logp)); each scaled by mask / row length."""
    N, T = logp.shape
    g = np.zeros((N, T))
    for n in range(N):
        length = sum(mask[n])
        for t in range(T):
            if mask[n, t] == 0:
                continue
            lp = float(logp[n, t])
            rho = math.exp(lp - float(old[n, t]))
            a = float(adv[n])
            unclipped_active = rho * a <= min(max(rho, 1 - clip_eps), 1 + clip_eps) * a
            d = -rho * a if unclipped_active else 0.0
            if ref is not None:
                d += kl_coeff * (1 - math.exp(float(ref[n, t]) - lp))
            g[n, t] = d / length
    return g


@pytest.mark.parametrize("with_ref", [True, False])
def test_gradient_wrt_logp_matches_analytic(with_ref):
    logp, old, ref, adv, mask = _loss_case()
    ref = ref if with_ref else None
    args = (mx.array(old), None if ref is None else mx.array(ref), mx.array(adv), mx.array(mask),
            per_sequence_weights(mask), objective())
    grad = np_(mx.grad(lambda lp: objective_sums(lp, *args).loss)(mx.array(logp)))
    expected = naive_grad_wrt_logp(logp, old, ref, adv, mask, 0.2, 0.04)
    np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gradient_wrt_logp_matches_finite_differences(variant):
    """Central differences of the float64 naive loss, incl. GSPO where one token moves its whole sequence's
    ratio, and a masked-out entry (gradient 0)."""
    logp, old, ref, adv, mask = _loss_case()
    kw = VARIANTS[variant]
    args = (mx.array(old), mx.array(ref), mx.array(adv), mx.array(mask), per_sequence_weights(mask),
            objective(**kw))
    grad = np_(mx.grad(lambda lp: objective_sums(lp, *args).loss)(mx.array(logp)))
    h = 1e-5
    for n, t in [(0, 0), (0, 3), (1, 2), (2, 0), (3, 5), (5, 4), (2, 3)]:
        plus, minus = logp.astype(np.float64), logp.astype(np.float64)
        plus[n, t] += h
        minus[n, t] -= h
        fd = (naive_loss_sum(plus, old, ref, adv, mask, 0.2, 0.04, **kw)
              - naive_loss_sum(minus, old, ref, adv, mask, 0.2, 0.04, **kw)) / (2 * h)
        np.testing.assert_allclose(grad[n, t], fd, rtol=1e-3, atol=1e-6)


def naive_tis_weights(old, sampler, mask, mode, cap):
    """Rollout-correction weights [N, T] from plain loops: the sampler ratio exp(old - sampler) per token, or
    exp(sum over the row's real tokens) per sequence; truncated at cap, or 0 past it (mask)."""
    N, T = old.shape
    out = np.zeros((N, T))
    for n in range(N):
        seq = sum(float(old[n, t]) - float(sampler[n, t]) for t in range(T) if mask[n, t] > 0)
        for t in range(T):
            r = math.exp(seq if mode.startswith("sequence") else float(old[n, t]) - float(sampler[n, t]))
            out[n, t] = min(r, cap) if mode.endswith("truncate") else (0.0 if r > cap else r)
    return out


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_rollout_correction_matches_naive(mode):
    logp, old, ref, adv, mask = _loss_case()
    rng = np.random.default_rng(5)
    # per-token differences of a few hundredths, some large enough to pass the cap
    sampler = (old - rng.normal(0.0, 0.3, size=old.shape)).astype(np.float32)
    cap = 1.5
    obj = dataclasses.replace(objective(kl_coeff=0.04), rollout_correction=mode, rollout_cap=cap)
    terms = token_terms(*(mx.array(a) for a in (logp, old, ref, adv, mask)), obj, mx.array(sampler))
    w = naive_tis_weights(old, sampler, mask, mode, cap)
    real = mask > 0
    assert np.any(w[real] == 0) or np.any(w[real] == cap)  # the cap binds somewhere
    loss, kl, *_ = naive_token_terms(logp, old, ref, adv, mask, 0.2, 0.04)
    # the weight multiplies the policy term only: loss = -(w * pg - beta * kl)
    pg = -(loss - 0.04 * kl)
    np.testing.assert_allclose(np_(terms.is_weight)[real], w[real], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np_(terms.loss)[real], (-(w * pg - 0.04 * kl))[real], rtol=1e-5, atol=1e-6)


def test_mismatch_sums_are_zero_for_one_model_and_k3_otherwise():
    logp, old, ref, adv, mask = _loss_case()
    obj = objective(kl_coeff=0.0)
    weights = mx.ones((logp.shape[0],))
    args = (mx.array(logp), mx.array(old), None, mx.array(adv), mx.array(mask), weights, obj)
    same = objective_sums(*args, mx.array(old))
    assert same.sampler_kl.item() == 0.0 and same.sampler_diff_max.item() == 0.0
    sampler = old - 0.1 * (np.arange(old.size).reshape(old.shape) % 3).astype(np.float32)
    sums = objective_sums(*args, mx.array(sampler))
    d = (old - sampler).astype(np.float64)
    real = mask > 0
    np.testing.assert_allclose(sums.sampler_kl.item(), (np.exp(d) - d - 1)[real].sum(), rtol=1e-5)
    np.testing.assert_allclose(sums.sampler_diff_max.item(), np.abs(d)[real].max(), rtol=1e-5)


# ----------------------------------------------------------------------------- CISPO and SAPO

def _sigmoid(x):
    return 1 / (1 + math.exp(-x))


@pytest.mark.parametrize("term", list(TERMS))
def test_cispo_sapo_objective_sums_match_naive(term):
    logp, old, ref, adv, mask = _loss_case()
    kw = TERMS[term]
    sums = loss_sums(logp, old, ref, adv, mask, objective(**kw))
    np.testing.assert_allclose(sums.loss.item(), naive_loss_sum(logp, old, ref, adv, mask, 0.2, 0.04, **kw),
                               rtol=RTOL, atol=ATOL)
    _, _, _, low, high = naive_token_terms(logp, old, ref, adv, mask, 0.2, 0.04, **kw)
    real = mask > 0
    assert sums.clipped_low.item() == 0.0  # neither clips from below
    np.testing.assert_allclose(sums.clipped_high.item(), high[real].sum())
    if term in ("cispo", "cispo_gspo"):
        assert high[real].sum() > 0  # the cap binds on this case
    if kw["loss_type"] == "sapo":
        assert high[real].sum() == 0  # a gate, no hard clip


def test_cispo_sapo_differ_from_each_other_and_from_grpo():
    logp, old, ref, adv, mask = _loss_case()
    values = {name: naive_loss_sum(logp, old, ref, adv, mask, 0.2, 0.04, **kw)
              for name, kw in {**TERMS, "grpo": {}}.items()}
    assert len({round(v, 9) for v in values.values()}) == len(values), values


@pytest.mark.parametrize("term", list(TERMS))
def test_cispo_sapo_gradient_matches_finite_differences(term):
    """Central differences of the float64 naive loss; CISPO's weight is detached, so the reference holds it
    at the unperturbed log-probs (weight_logp); GSPO's sequence ratio moves with every token of the row."""
    logp, old, ref, adv, mask = _loss_case()
    kw = TERMS[term]
    args = (mx.array(old), mx.array(ref), mx.array(adv), mx.array(mask), per_sequence_weights(mask),
            objective(**kw))
    grad = np_(mx.grad(lambda lp: objective_sums(lp, *args).loss)(mx.array(logp)))
    h = 1e-5
    base = logp.astype(np.float64)
    for n, t in [(0, 0), (0, 3), (1, 2), (2, 0), (3, 5), (5, 4), (2, 3), (4, 1)]:
        plus, minus = base.copy(), base.copy()
        plus[n, t] += h
        minus[n, t] -= h
        fd = (naive_loss_sum(plus, old, ref, adv, mask, 0.2, 0.04, weight_logp=base, **kw)
              - naive_loss_sum(minus, old, ref, adv, mask, 0.2, 0.04, weight_logp=base, **kw)) / (2 * h)
        np.testing.assert_allclose(grad[n, t], fd, rtol=1e-3, atol=1e-6)


def naive_policy_grad(logp, old, adv, mask, loss_type, cispo_cap=5.0, tau_pos=1.0, tau_neg=1.05):
    """d(sum of per-sequence token means of -pg)/d logp per token, from the formulas: CISPO -min(rho, cap) * A
    (the weight is a constant); SAPO -4 s (1 - s) * rho * A with s = sigmoid(tau (rho - 1)); / row length."""
    N, T = logp.shape
    g = np.zeros((N, T))
    for n in range(N):
        length, a = mask[n].sum(), float(adv[n])
        for t in range(T):
            if mask[n, t] == 0:
                continue
            rho = math.exp(float(logp[n, t]) - float(old[n, t]))
            if loss_type == "cispo":
                g[n, t] = -min(rho, cispo_cap) * a / length
            else:
                tau = tau_pos if a > 0 else tau_neg
                s = _sigmoid(tau * (rho - 1))
                g[n, t] = -4 * s * (1 - s) * rho * a / length
    return g


def _policy_grad(logp, old, adv, mask, obj):
    args = (mx.array(old), None, mx.array(adv), mx.array(mask), per_sequence_weights(mask), obj)
    return np_(mx.grad(lambda lp: objective_sums(lp, *args).loss)(mx.array(logp)))


@pytest.mark.parametrize("term", ["cispo", "cispo_default_cap", "sapo", "sapo_hot"])
def test_cispo_sapo_gradient_matches_analytic(term):
    logp, old, _, adv, mask = _loss_case()
    kw = TERMS[term]
    grad = _policy_grad(logp, old, adv, mask, objective(kl_coeff=0.0, **kw))
    expected = naive_policy_grad(logp, old, adv, mask, **{k: v for k, v in kw.items()})
    np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("term", list(TERMS))
def test_cispo_sapo_on_policy_match_grpo_gradient(term):
    """old = logp (ratio 1): CISPO's weight is 1 and SAPO's gate has slope 1, so both give GRPO's gradient
    -A / len per token; the values are CISPO -A * logp and SAPO -(2 / tau) * A per token; nothing clipped."""
    logp, _, _, adv, mask = _loss_case()
    kw = TERMS[term]
    obj = objective(kl_coeff=0.0, **kw)
    grad = _policy_grad(logp, logp, adv, mask, obj)
    np.testing.assert_allclose(grad, _policy_grad(logp, logp, adv, mask, objective(kl_coeff=0.0)), rtol=1e-6,
                               atol=1e-8)
    assert np.any(grad != 0)
    sums = loss_sums(logp, logp, None, adv, mask, obj)
    real = mask > 0
    a = np.broadcast_to(adv.astype(np.float64)[:, None], logp.shape)
    if kw["loss_type"] == "cispo":
        per_token = -a * logp
    else:
        per_token = -2 / np.where(a > 0, kw.get("tau_pos", 1.0), kw.get("tau_neg", 1.05)) * a
    expected = sum(per_token[n][real[n]].mean() for n in range(len(adv)))
    np.testing.assert_allclose(sums.loss.item(), expected, rtol=RTOL, atol=ATOL)
    assert sums.clipped_low.item() == 0.0 and sums.clipped_high.item() == 0.0 and sums.ratio_max.item() == 1.0


def test_cispo_keeps_the_gradient_of_tokens_past_the_cap():
    """Where PPO's clip zeroes a token's gradient (rho > 1 + eps, A > 0), CISPO keeps -cap * A / len; below
    the cap its gradient is -rho * A / len, GRPO's unclipped one."""
    logp, old, _, adv, mask = _loss_case()
    cap = 1.3
    cispo = _policy_grad(logp, old, adv, mask, objective(kl_coeff=0.0, loss_type="cispo", cispo_cap=cap))
    grpo = _policy_grad(logp, old, adv, mask, objective(kl_coeff=0.0))
    rho = np.exp(logp.astype(np.float64) - old)
    a = np.broadcast_to(adv.astype(np.float64)[:, None], rho.shape)
    length = mask.sum(axis=1, keepdims=True)
    real = mask > 0
    past = real & (rho > cap) & (a > 0)
    assert past.any() and np.all(grpo[past] == 0.0)
    np.testing.assert_allclose(cispo[past], (-cap * a / length)[past], rtol=1e-5)
    inside = real & (rho < 1.2) & (rho > 0.8) & (a != 0)  # GRPO unclipped here too
    assert inside.any()
    np.testing.assert_allclose(cispo[inside], grpo[inside], rtol=1e-5)
    below = real & (rho < 0.8) & (a < 0)  # PPO clips these; CISPO has no lower bound
    assert below.any() and np.all(grpo[below] == 0.0)
    np.testing.assert_allclose(cispo[below], (-rho * a / length)[below], rtol=1e-5)


def test_sapo_gate_is_soft_and_picks_its_temperature_by_the_sign_of_the_advantage():
    """SAPO's gradient weight 4 s (1 - s) rho (relative to -A / len) is 1 at rho = 1, positive everywhere
    (tokens PPO clips keep a signal) and shrinks with |rho - 1| faster for a hotter gate; tau_pos acts only
    on rows with A > 0, tau_neg only on rows with A <= 0."""
    logp, old, _, adv, mask = _loss_case()
    rho = np.exp(logp.astype(np.float64) - old)
    a = np.broadcast_to(adv.astype(np.float64)[:, None], rho.shape)
    length = mask.sum(axis=1, keepdims=True)
    real = (mask > 0) & (a != 0)

    def relative(tau_pos, tau_neg):  # the gradient weight per token
        g = _policy_grad(logp, old, adv, mask, objective(kl_coeff=0.0, loss_type="sapo", tau_pos=tau_pos,
                                                         tau_neg=tau_neg))
        return np.where(real, g / np.where(real, -a / length, 1.0), 0.0)

    mild, hot = relative(1.0, 1.05), relative(6.0, 6.0)
    assert np.all(mild[real] > 0) and np.all(hot[real] > 0)
    far = real & (np.abs(rho - 1) > 0.25)
    assert far.any() and np.all(hot[far] < mild[far])
    clipped_by_ppo = real & (((rho > 1.2) & (a > 0)) | ((rho < 0.8) & (a < 0)))
    assert clipped_by_ppo.any() and np.all(hot[clipped_by_ppo] > 0)
    pos, neg = real & (a > 0), real & (a < 0)
    changed_pos = relative(3.0, 1.05)
    np.testing.assert_array_equal(changed_pos[neg], mild[neg])
    assert np.all(changed_pos[pos & (np.abs(rho - 1) > 0.05)] != mild[pos & (np.abs(rho - 1) > 0.05)])
    changed_neg = relative(1.0, 3.0)
    np.testing.assert_array_equal(changed_neg[pos], mild[pos])
    assert np.all(changed_neg[neg & (np.abs(rho - 1) > 0.05)] != mild[neg & (np.abs(rho - 1) > 0.05)])


@pytest.mark.parametrize("term", list(TERMS))
def test_cispo_sapo_padding_with_garbage_does_not_change_loss_or_gradient(term):
    logp, old, ref, adv, mask = _loss_case()
    obj = objective(**TERMS[term])
    base = loss_sums(logp, old, ref, adv, mask, obj)
    args = (mx.array(old), mx.array(ref), mx.array(adv), mx.array(mask), per_sequence_weights(mask), obj)
    base_grad = np_(mx.grad(lambda lp: objective_sums(lp, *args).loss)(mx.array(logp)))
    rng = np.random.default_rng(4)
    for extra in (1, 5):
        p_logp, p_old, p_ref, p_mask = _pad(logp, old, ref, mask, extra, rng, -30.0, 5.0)
        padded = loss_sums(p_logp, p_old, p_ref, adv, p_mask, obj)
        for a, b in zip(base, padded):
            np.testing.assert_allclose(b.item(), a.item(), rtol=RTOL, atol=ATOL)
        p_args = (mx.array(p_old), mx.array(p_ref), mx.array(adv), mx.array(p_mask), per_sequence_weights(p_mask),
                  obj)
        grad = np_(mx.grad(lambda lp: objective_sums(lp, *p_args).loss)(mx.array(p_logp)))
        assert np.all(grad[p_mask == 0] == 0.0)
        T = logp.shape[1]
        np.testing.assert_allclose(grad[:, :T][mask > 0], base_grad[mask > 0], rtol=1e-5, atol=1e-8)


def test_loss_types_are_declared_once():
    """Every loss type is one LOSSES entry: row_scales and token_terms read it, nothing else lists names."""
    assert LOSS_TYPES == tuple(LOSSES) and {"grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"} <= set(LOSS_TYPES)
    for name, spec in LOSSES.items():
        assert callable(spec.term) and callable(spec.norm), name
    lengths, keep = [np.array([3, 5])], [np.array([True, True])]
    np.testing.assert_allclose(row_scales(lengths, keep, "cispo", 8)[0], row_scales(lengths, keep, "dapo", 8)[0])
    np.testing.assert_allclose(row_scales(lengths, keep, "sapo", 8)[0], row_scales(lengths, keep, "grpo", 8)[0])
    with pytest.raises(ValueError, match="unknown loss_type"):
        row_scales(lengths, keep, "ppo", 8)


# ----------------------------------------------------------------------------- on-policy distillation

def _teacher(old, seed=7):
    """A teacher's log-probs of the sampled tokens: the student's, moved by up to +-1.5 nats."""
    return (old + np.random.default_rng(seed).uniform(-1.5, 1.5, size=old.shape)).astype(np.float32)


def distill_sums(logp, old, ref, adv, mask, teacher, obj, weights=None):
    arrays = [None if a is None else mx.array(a) for a in (logp, old, ref, adv, mask)]
    w = per_sequence_weights(mask) if weights is None else weights
    return objective_sums(*arrays, w, obj, teacher_logp=None if teacher is None else mx.array(teacher))


DISTILL = {"grpo": {}, "gspo": {"sequence": True}, "cispo": {"loss_type": "cispo", "cispo_cap": 1.3},
           "sapo": {"loss_type": "sapo"}}


@pytest.mark.parametrize("variant", list(DISTILL))
@pytest.mark.parametrize("distill", [1.0, 0.3])
def test_distill_objective_sums_match_naive(variant, distill):
    logp, old, ref, adv, mask = _loss_case()
    teacher = _teacher(old)
    kw = DISTILL[variant]
    sums = distill_sums(logp, old, ref, adv, mask, teacher, objective(distill=distill, **kw))
    want = naive_loss_sum(logp, old, ref, adv, mask, 0.2, 0.04, teacher=teacher, distill=distill, **kw)
    np.testing.assert_allclose(sums.loss.item(), want, rtol=RTOL, atol=ATOL)
    real = mask > 0
    np.testing.assert_allclose(sums.teacher_kl.item(), (old.astype(np.float64) - teacher)[real].sum(), rtol=RTOL)
    # the teacher moves the loss: it is not GRPO's
    assert abs(want - naive_loss_sum(logp, old, ref, adv, mask, 0.2, 0.04, **kw)) > 1e-3


def test_pure_distillation_needs_no_reward_and_a_teacher_that_agrees_adds_nothing():
    logp, old, ref, adv, mask = _loss_case()
    obj = objective(distill=1.0)
    plain = distill_sums(logp, old, ref, adv, mask, None, obj)
    same = distill_sums(logp, old, ref, adv, mask, old, obj)  # the teacher is the sampling policy
    for name, a, b in zip(plain._fields, plain, same):
        np.testing.assert_array_equal(np.array(a), np.array(b), err_msg=name)
    grad = lambda teacher: np_(mx.grad(lambda lp: distill_sums(lp, old, ref, adv, mask, teacher, obj).loss)(  # noqa: E731
        mx.array(logp)))
    np.testing.assert_array_equal(grad(None), grad(old))
    # no reward signal (all advantages 0), on-policy: the gradient raises the tokens the teacher likes more
    zero = np.zeros_like(adv)
    g = np_(mx.grad(lambda lp: distill_sums(lp, logp, None, zero, mask, _teacher(logp), obj).loss)(mx.array(logp)))
    real = mask > 0
    assert np.all(np.sign(-g[real]) == np.sign((_teacher(logp) - logp)[real]))


@pytest.mark.parametrize("variant", list(DISTILL))
def test_distill_gradient_matches_finite_differences(variant):
    logp, old, ref, adv, mask = _loss_case()
    teacher = _teacher(old)
    kw = DISTILL[variant]
    obj = objective(distill=0.5, **kw)
    grad = np_(mx.grad(lambda lp: distill_sums(lp, old, ref, adv, mask, teacher, obj).loss)(mx.array(logp)))
    h = 1e-5
    for n, t in [(0, 0), (0, 3), (1, 2), (2, 0), (3, 5), (5, 4), (2, 3)]:
        plus, minus = logp.astype(np.float64), logp.astype(np.float64)
        plus[n, t] += h
        minus[n, t] -= h
        extra = dict(teacher=teacher, distill=0.5, weight_logp=logp if kw.get("loss_type") == "cispo" else None, **kw)
        fd = (naive_loss_sum(plus, old, ref, adv, mask, 0.2, 0.04, **extra)
              - naive_loss_sum(minus, old, ref, adv, mask, 0.2, 0.04, **extra)) / (2 * h)
        np.testing.assert_allclose(grad[n, t], fd, rtol=1e-3, atol=1e-6)


def test_distill_padding_and_accumulation_invariance():
    logp, old, ref, adv, mask = _loss_case()
    teacher = _teacher(old)
    obj = objective(distill=1.0)
    base = distill_sums(logp, old, ref, adv, mask, teacher, obj)
    rng = np.random.default_rng(5)
    p_logp, p_old, p_ref, p_mask = _pad(logp, old, ref, mask, 4, rng, -30.0, 5.0)
    p_teacher = np.where(p_mask == 0, rng.uniform(-30.0, 5.0, size=p_mask.shape), 0.0).astype(np.float32)
    p_teacher[:, :teacher.shape[1]] = np.where(mask > 0, teacher, p_teacher[:, :teacher.shape[1]])
    padded = distill_sums(p_logp, p_old, p_ref, adv, p_mask, p_teacher, obj, per_sequence_weights(mask))
    for name, a, b in zip(base._fields, base, padded):
        np.testing.assert_allclose(b.item(), a.item(), rtol=RTOL, atol=ATOL, err_msg=name)
    # the rows in two micro-batches add up to the whole
    w = per_sequence_weights(mask)
    parts = [distill_sums(logp[r], old[r], ref[r], adv[r], mask[r], teacher[r], obj, w[mx.array(r)])
             for r in (np.arange(0, 2), np.arange(2, 6))]
    np.testing.assert_allclose(parts[0].loss.item() + parts[1].loss.item(), base.loss.item(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(parts[0].teacher_kl.item() + parts[1].teacher_kl.item(), base.teacher_kl.item(),
                               rtol=RTOL, atol=ATOL)
