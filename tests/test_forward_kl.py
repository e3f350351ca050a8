"""distill_topk, the top-k forward KL to a teacher, against naive float64 references written from the formula:
the loss term (values, renormalisation, finite-difference gradients through the student's logits, a teacher
identical to the student, padding, accumulation), the student's log-probs at the extra ids from the chunked
output head (values and both gradients), and the teacher's top-k pass. Runs: tests/test_distill.py."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from mlx_grpo.loss import Objective, objective_sums, row_scales, topk_forward_kl
from mlx_grpo.models import forward
from mlx_grpo.models.forward import completion_logprobs, completion_topk, linear_head_logprobs, pack, token_logprobs

RTOL = 1e-5
ATOL = 1e-6


def np_(x):
    return np.array(x.astype(mx.float32).tolist(), dtype=np.float64)


# ----------------------------------------------------------------------------- naive references

def naive_log_softmax(row):
    row = np.asarray(row, dtype=np.float64)
    m = row.max()
    return row - (m + math.log(sum(math.exp(v - m) for v in row)))


def naive_topk(teacher_logits, k):
    """The teacher's k most likely ids per position [n, T, k] and their log-probs, descending."""
    n, T, _ = teacher_logits.shape
    ids, lps = np.zeros((n, T, k), np.int64), np.zeros((n, T, k))
    for i in range(n):
        for t in range(T):
            lt = naive_log_softmax(teacher_logits[i, t])
            ids[i, t] = np.argsort(-lt, kind="stable")[:k]
            lps[i, t] = lt[ids[i, t]]
    return ids, lps


def naive_forward_kl(student_logits, teacher_logits, k):
    """sum_i q_i (log q_i - log p_student(i)) over the teacher's top k, q renormalised over them. [n, T]."""
    ids, lps = naive_topk(teacher_logits, k)
    n, T, _ = teacher_logits.shape
    out = np.zeros((n, T))
    for i in range(n):
        for t in range(T):
            ls = naive_log_softmax(student_logits[i, t])
            z = sum(math.exp(v) for v in lps[i, t])
            for j in range(k):
                q = math.exp(lps[i, t, j]) / z
                out[i, t] += q * (math.log(q) - ls[ids[i, t, j]])
    return out


def naive_term(student_logits, teacher_logits, k, mask, weights, coeff):
    """coeff * sum_i w_i sum_t mask_it * forward_kl_it: the loss's top-k term."""
    return coeff * float((naive_forward_kl(student_logits, teacher_logits, k) * mask).sum(axis=1) @ weights)


# ----------------------------------------------------------------------------- the loss term

def case(seed=3, n=6, T=7, V=11):
    """Student and teacher logits that disagree, masks of different lengths incl. a 1-token row, sampled ids."""
    rng = np.random.default_rng(seed)
    student = rng.normal(scale=1.5, size=(n, T, V))
    teacher = rng.normal(scale=2.0, size=(n, T, V))
    mask = np.zeros((n, T), np.float32)
    for i, length in enumerate([7, 4, 1, 6, 3, 5][:n]):
        mask[i, :length] = 1
    sampled = rng.integers(0, V, size=(n, T))
    return student, teacher, mask, sampled


def sums_of(student_logits, teacher_logits, k, mask, sampled, weights, coeff, adv=None, topk=True):
    """objective_sums on the student's logits: the sampled tokens' log-probs (on-policy: old = their stop
    gradient), and with `topk` the student's log-probs at the teacher's top-k ids."""
    n = mask.shape[0]
    lsm = student_logits - mx.logsumexp(student_logits, axis=-1, keepdims=True)  # [n, T, V]
    logp = mx.take_along_axis(lsm, mx.array(sampled)[..., None], axis=-1).squeeze(-1)
    ids, t_lp = naive_topk(np.asarray(teacher_logits), k)
    pair = (mx.take_along_axis(lsm, mx.array(ids), axis=-1), mx.array(t_lp, dtype=mx.float32)) if topk else None
    obj = Objective(kl_coeff=0.0, topk_coeff=coeff)
    adv = mx.zeros(n) if adv is None else mx.array(adv)
    return objective_sums(logp, mx.stop_gradient(logp), None, adv, mx.array(mask), mx.array(weights), obj,
                          topk=pair)


@pytest.mark.parametrize("k", [1, 4, 11])
@pytest.mark.parametrize("coeff", [1.0, 0.3])
def test_topk_term_matches_naive(k, coeff):
    """The loss adds coeff * sum_i w_i sum_t mask forward_kl to the policy term, with the same row weights;
    forward_kl logs the kept tokens' sum."""
    student, teacher, mask, sampled = case()
    w = (1.0 / mask.sum(axis=1)).astype(np.float32)
    adv = np.array([1.3, -0.8, 0.6, -1.7, 0.0, 2.1], np.float32)
    s = mx.array(student, dtype=mx.float32)
    with_term = sums_of(s, teacher, k, mask, sampled, w, coeff, adv)
    without = sums_of(s, teacher, k, mask, sampled, w, coeff, adv, topk=False)
    want = naive_term(student, teacher, k, mask, w.astype(np.float64), coeff)
    np.testing.assert_allclose(with_term.loss.item() - without.loss.item(), want, rtol=1e-4, atol=1e-5)
    fkl = naive_forward_kl(student, teacher, k)
    np.testing.assert_allclose(with_term.forward_kl.item(), fkl[mask > 0].sum(), rtol=RTOL, atol=1e-4)
    assert without.forward_kl.item() == 0.0
    assert np.all(fkl[mask > 0] > 0)  # renormalised over the top k: a divergence, > 0 where they differ


def test_renormalised_term_is_zero_exactly_when_the_student_is_the_renormalised_teacher():
    """q is renormalised over the top k: a student that puts the teacher's top-k probabilities, renormalised,
    on those k tokens and nothing elsewhere scores 0, and any other student more."""
    student, teacher, mask, _ = case()
    k = 3
    ids, t_lp = naive_topk(teacher, k)
    q = np.exp(t_lp) / np.exp(t_lp).sum(axis=-1, keepdims=True)
    matched = np.full_like(teacher, -1e4)  # ~0 probability off the top k
    np.put_along_axis(matched, ids, np.log(q), axis=-1)
    lsm = lambda x: x - mx.logsumexp(x, axis=-1, keepdims=True)  # noqa: E731
    at = lambda x: mx.take_along_axis(lsm(mx.array(x, dtype=mx.float32)), mx.array(ids), axis=-1)  # noqa: E731
    teacher_lp = mx.array(t_lp, dtype=mx.float32)
    assert np.abs(np_(topk_forward_kl(at(matched), teacher_lp))).max() < 1e-5
    others = np_(topk_forward_kl(at(student), teacher_lp))
    assert others.min() > 1e-3
    # the unrenormalised partial sum would be the renormalised one times the teacher's top-k mass plus
    # mass * log(mass): negative for this matched student, not a divergence
    mass = np.exp(t_lp).sum(axis=-1)
    assert np.all(mass * np.log(mass) < 0)


def test_topk_gradient_matches_finite_differences():
    """d loss / d student logits of the top-k term (advantages 0: the policy term adds no gradient)."""
    student, teacher, mask, sampled = case()
    k, coeff = 4, 0.7
    w = (1.0 / mask.sum(axis=1)).astype(np.float32)
    grad = np_(mx.grad(lambda s: sums_of(s, teacher, k, mask, sampled, w, coeff).loss)(
        mx.array(student, dtype=mx.float32)))
    h = 1e-5
    ids, _ = naive_topk(teacher, k)
    points = [(0, 0, ids[0, 0, 0]), (0, 3, ids[0, 3, 2]), (1, 2, 0), (2, 0, ids[2, 0, 1]), (3, 5, 7), (5, 4, 10),
              (4, 6, 3)]  # (4, 6) is padding: no gradient
    for i, t, v in points:
        plus, minus = student.copy(), student.copy()
        plus[i, t, v] += h
        minus[i, t, v] -= h
        fd = (naive_term(plus, teacher, k, mask, w.astype(np.float64), coeff)
              - naive_term(minus, teacher, k, mask, w.astype(np.float64), coeff)) / (2 * h)
        np.testing.assert_allclose(grad[i, t, v], fd, rtol=1e-3, atol=1e-6)
    assert np.all(grad[4, 3:] == 0)


def test_a_teacher_identical_to_the_student_at_k_vocab_gives_zero_and_no_gradient():
    student, _, mask, sampled = case()
    V = student.shape[-1]
    w = (1.0 / mask.sum(axis=1)).astype(np.float32)
    s = mx.array(student, dtype=mx.float32)
    sums = sums_of(s, student, V, mask, sampled, w, 1.0)
    assert abs(sums.forward_kl.item()) < 1e-5 and abs(sums.loss.item()) < 1e-5
    grad = np_(mx.grad(lambda x: sums_of(x, student, V, mask, sampled, w, 1.0).loss)(s))
    assert np.abs(grad).max() < 1e-6


def test_topk_term_padding_and_accumulation_invariance():
    """Garbage at masked positions (student and teacher) changes neither value nor gradient; one batch step
    of 6 rows equals 6 steps of one row each (row_scales' weights, 1x6 == 6x1) for the token-averaged types."""
    student, teacher, mask, sampled = case()
    k = 4
    rng = np.random.default_rng(8)
    w = (1.0 / mask.sum(axis=1)).astype(np.float32)
    base = sums_of(mx.array(student, dtype=mx.float32), teacher, k, mask, sampled, w, 1.0)
    g_base = np_(mx.grad(lambda s: sums_of(s, teacher, k, mask, sampled, w, 1.0).loss)(
        mx.array(student, dtype=mx.float32)))
    pad = lambda a: np.concatenate([a, rng.normal(scale=30.0, size=(a.shape[0], 3, a.shape[2]))], axis=1)  # noqa: E731
    p_student, p_teacher = pad(student), pad(teacher)
    off = np.concatenate([mask, np.zeros((6, 3), np.float32)], axis=1) == 0
    p_student[off] = rng.normal(scale=30.0, size=p_student[off].shape)
    p_teacher[off] = rng.normal(scale=30.0, size=p_teacher[off].shape)
    p_mask = np.concatenate([mask, np.zeros((6, 3), np.float32)], axis=1)
    p_sampled = np.concatenate([sampled, rng.integers(0, 11, size=(6, 3))], axis=1)
    padded = sums_of(mx.array(p_student, dtype=mx.float32), p_teacher, k, p_mask, p_sampled, w, 1.0)
    for name in ("loss", "forward_kl", "tokens"):
        np.testing.assert_allclose(getattr(padded, name).item(), getattr(base, name).item(), rtol=RTOL, err_msg=name)
    g_pad = np_(mx.grad(lambda s: sums_of(s, p_teacher, k, p_mask, p_sampled, w, 1.0).loss)(
        mx.array(p_student, dtype=mx.float32)))
    np.testing.assert_allclose(g_pad[:, :7], g_base, rtol=1e-5, atol=1e-7)
    assert np.all(g_pad[off] == 0)
    lengths, keep = mask.sum(axis=1), np.ones(6, bool)
    for loss_type in ("grpo", "dapo", "dr_grpo"):
        (whole_w,) = row_scales([lengths], [keep], loss_type, 7)
        parts_w = row_scales([lengths[i:i + 1] for i in range(6)], [keep[i:i + 1] for i in range(6)], loss_type, 7)
        whole = sums_of(mx.array(student, dtype=mx.float32), teacher, k, mask, sampled, whole_w, 1.0).loss.item()
        parts = sum(sums_of(mx.array(student[i:i + 1], dtype=mx.float32), teacher[i:i + 1], k, mask[i:i + 1],
                            sampled[i:i + 1], parts_w[i], 1.0).loss.item() for i in range(6))
        np.testing.assert_allclose(parts, whole, rtol=1e-5, err_msg=loss_type)


# ----------------------------------------------------------------------------- the student's side: extra ids

@pytest.mark.parametrize("softcap", [None, 15.0])
@pytest.mark.parametrize("chunk", [1, 5, 13, 20])
def test_linear_head_with_several_targets_matches_autograd_of_naive_formula(chunk, softcap):
    """K targets per position (one listed twice) through the chunked head: values and both gradients equal
    autograd through the full logits."""
    rng = np.random.default_rng(10)
    M, D, V, K, temperature = 13, 16, 29, 4, 0.8
    hidden = mx.array(rng.normal(size=(M, D)).astype(np.float32))
    weight = mx.array((rng.normal(size=(V, D)) * 5.0).astype(np.float32))
    targets = rng.integers(0, V, size=(M, K)).astype(np.int32)
    targets[:, 3] = targets[:, 0]  # the sampled token among the teacher's top k: its gradient adds twice
    targets = mx.array(targets)
    cot = mx.array(rng.normal(size=(M, K)).astype(np.float32))

    def naive(h, w):
        u = h @ w.T
        return token_logprobs(u if softcap is None else softcap * mx.tanh(u / softcap), targets, temperature, True)

    def chunked(h, w):
        return linear_head_logprobs(h, w, targets, temperature, chunk, softcap)

    assert chunked(hidden, weight).shape == (M, K)
    np.testing.assert_allclose(np_(chunked(hidden, weight)), np_(naive(hidden, weight)), rtol=1e-5, atol=1e-5)
    grads = [mx.grad(lambda h, w: (fn(h, w) * cot).sum(), argnums=(0, 1))(hidden, weight) for fn in (chunked, naive)]
    for name, got, expected in zip(("d hidden", "d weight"), grads[0], grads[1]):
        np.testing.assert_allclose(np_(got), np_(expected), rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load(str(tiny_model_dir))


def tiny_batch(V, rng, n=3, T=6):
    prompts = [list(rng.integers(3, V, size=p)) for p in (4, 7, 2)][:n]
    completions = mx.array(rng.integers(3, V, size=(n, T)).astype(np.int32))
    mask = mx.array((np.arange(T)[None] < np.array([6, 3, 5])[:n, None]).astype(np.float32))
    return pack([[int(x) for x in p] for p in prompts], completions, mask, 0)


def full_logits(model, batch):
    logits = model(batch.inputs)
    return np.asarray(mx.take_along_axis(logits, batch.positions[..., None], axis=1).astype(mx.float32))


@pytest.mark.parametrize("chunk", [None, 4])
def test_completion_logprobs_at_extra_ids_match_full_logits(tiny, chunk):
    """The student's log-probs at k extra ids per position come from the head pass of the sampled tokens:
    the sampled tokens' log-probs are unchanged, the extra ones equal the full logits' log-softmax."""
    model, tok = tiny
    V = model.args.vocab_size
    rng = np.random.default_rng(2)
    batch = tiny_batch(V, rng)
    extra = mx.array(rng.integers(0, V, size=(*batch.targets.shape, 5)).astype(np.int32))
    lp, extra_lp = completion_logprobs(model, batch, 0.9, chunk_tokens=chunk, extra=extra)
    alone = completion_logprobs(model, batch, 0.9, chunk_tokens=chunk)
    np.testing.assert_allclose(np_(lp), np_(alone), rtol=1e-6, atol=1e-6)
    logits = full_logits(model, batch) / 0.9
    want = np.take_along_axis(logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
                              - logits.max(-1, keepdims=True), np.asarray(extra), axis=-1)
    np.testing.assert_allclose(np_(extra_lp), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("split", [True, False])
def test_completion_topk_matches_naive_topk_of_full_logits(tiny, monkeypatch, split):
    """The teacher's pass: the sampled tokens' log-probs as completion_logprobs gives them, and the k most
    likely ids with their log-probs (descending), from the chunked head or the full-logits path."""
    model, _ = tiny
    if not split:
        monkeypatch.setattr(forward, "logit_split", lambda m: None)
    V, k, temperature = model.args.vocab_size, 6, 0.7
    batch = tiny_batch(V, np.random.default_rng(4))
    lp, top, ids = completion_topk(model, batch, temperature, k, chunk_tokens=5)
    np.testing.assert_allclose(np_(lp), np_(completion_logprobs(model, batch, temperature)), rtol=1e-5, atol=1e-5)
    want_ids, want_lp = naive_topk(full_logits(model, batch) / temperature, k)
    assert ids.dtype == mx.int32 and ids.shape == (3, 6, k)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np_(top), want_lp, rtol=1e-4, atol=1e-4)


def test_completion_topk_stays_below_the_tokenizers_ids(tiny):
    """A teacher whose head has rows past the tokenizer's ids (padded heads: Qwen2.5-7B's 152,064 rows against
    the 0.5B's 151,936) picks its top k among the tokenizer's ids only: the student's gather has no row past them."""
    model, _ = tiny
    V, k = model.args.vocab_size, 6
    batch = tiny_batch(V, np.random.default_rng(4))
    _, top, ids = completion_topk(model, batch, 1.0, k, chunk_tokens=5)
    limit = int(np.asarray(ids).max())  # a limit the unrestricted top k crosses
    _, top_in, ids_in = completion_topk(model, batch, 1.0, k, chunk_tokens=5, tokens=limit)
    assert int(np.asarray(ids_in).max()) < limit
    want_ids, want_lp = naive_topk((full_logits(model, batch))[..., :limit], k)  # log-probs over every row
    np.testing.assert_array_equal(np.asarray(ids_in), want_ids)
    z = full_logits(model, batch)
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) + z.max(-1, keepdims=True)
    np.testing.assert_allclose(np_(top_in), np.take_along_axis(z - lse, want_ids, axis=-1), rtol=1e-4, atol=1e-4)


def test_a_token_the_teacher_gives_no_mass_adds_nothing():
    """log q = -inf (a served teacher's, or a masked logit) adds 0 to the term and its gradient, not NaN."""
    teacher = mx.array([[[-0.1, -2.5, -mx.inf]]])
    student = mx.array([[[-0.3, -1.0, -4.0]]])
    value, grad = mx.value_and_grad(lambda s: topk_forward_kl(s, teacher).sum())(student)
    finite = topk_forward_kl(student[..., :2], teacher[..., :2])
    assert np.isfinite(np_(value)).all() and np.isfinite(np_(grad)).all()
    np.testing.assert_allclose(np_(value), np_(finite.sum()), rtol=1e-6)
    assert float(grad[0, 0, 2]) == 0.0


# ----------------------------------------------------------------------------- through the gradient pass

@pytest.mark.parametrize("micro,max_tokens,loss_type,compiled", [(1, 0, "grpo", False), (3, 40, "grpo", False),
                                                                 (3, 0, "dapo", False), (3, 40, "dr_grpo", True),
                                                                 (64, 0, "grpo", True)])
def test_topk_accumulation_1x8_equals_8x1(tiny_model_dir, tmp_path, micro, max_tokens, loss_type, compiled):
    """With the teacher's top-k in the records: one batch step of 8 prompts == 8 accumulated steps of 1, every
    micro-batching, compiled or not; the term moves the gradient (not a vacuous comparison)."""
    from mlx.utils import tree_flatten

    from mlx_grpo.config import build_config, parse_set
    from mlx_grpo.loss import group_advantages
    from mlx_grpo.models.tiny import write_tiny_model
    from mlx_grpo.rollout.decode import generate_rollout
    from mlx_grpo.rollout.rollout_records import Rollout, SamplingParams
    from mlx_grpo.training.optimization import accumulate_gradients, loss_weights, make_grad_fn
    from mlx_grpo.training.policy import topk_pass
    from mlx_grpo.training.records import StepData, TeacherTopK

    model, tok = load(str(tiny_model_dir))
    teacher = load(str(write_tiny_model(tmp_path / "teacher", seed=5)))[0]
    base = [f"model_name={tiny_model_dir}", f"output_dir={tmp_path}", "batch_size=2", "num_generations=4",
            "max_new_tokens=8", "max_prompt_length=96", "system_prompt=", "kl_coeff=0", f"loss_type={loss_type}",
            "teacher_model=x", "distill_coeff=0.5", "distill_topk=6", "distill_topk_coeff=0.7",
            f"use_compile={str(compiled).lower()}"]
    cfg = build_config("train", overrides=parse_set(base))
    prompts = [tok.encode(f"question {i}" + "?" * i) for i in range(8)]
    big = generate_rollout(model, tok, prompts, 4, SamplingParams(8, 1.0), mx.random.key(0))
    adv = group_advantages(mx.array(np.random.default_rng(0).normal(size=32).astype(np.float32)), 4)
    lp, top = topk_pass(teacher, big, 1.0, 5, 0, 6)

    def part(p):
        rows = slice(p * 4, (p + 1) * 4)
        r = Rollout([big.prompt_ids[p]], big.completion_ids[rows], big.mask[rows], big.sampler_logprobs[rows],
                    big.truncated[rows], big.texts[rows], 4)
        return StepData(r, adv[rows], None, None, lp[rows], TeacherTopK(top.ids[rows], top.logprobs[rows]))

    one, eight = [StepData(big, adv, None, None, lp, top)], [part(p) for p in range(8)]
    without = [StepData(big, adv, None, None, lp, None)]
    step = make_grad_fn(cfg, model)
    g1, sums1 = accumulate_gradients(step, one, loss_weights(cfg, one), micro, 0, max_tokens)
    g8, sums8 = accumulate_gradients(step, eight, loss_weights(cfg, eight), micro, 0, max_tokens)
    g0, _ = accumulate_gradients(step, without, loss_weights(cfg, without), micro, 0, max_tokens)
    for name, a, b in zip(sums1._fields, sums1, sums8):
        assert a.item() == pytest.approx(b.item(), rel=1e-5, abs=1e-7), name
    assert sums1.forward_kl.item() > 0
    for (k, a), (_, b) in zip(tree_flatten(g1), tree_flatten(g8)):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-7, err_msg=k)
    assert max(float(mx.abs(a - b).max()) for (_, a), (_, b) in zip(tree_flatten(g1), tree_flatten(g0))) > 1e-4
