"""Demonstrations in the group (data/demonstrations.py): which groups get one, the demonstration row's tokens and
masks, the objective on a batch mixing sampled and demonstration rows against naive references written from
docs/algorithms-demonstrations.md, the logged demo_fraction and completions.jsonl rows, and exact resume."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_grpo.base.errors import UserError
from mlx_grpo.commands import train as run_mod
from mlx_grpo.config import build_config, parse_set
from mlx_grpo.data.demonstrations import Demonstrator, groups_without_reward, with_demonstrations
from mlx_grpo.data.examples import Example
from mlx_grpo.loss import Objective, objective_sums
from mlx_grpo.rewards.scoring import RewardScores, RewardSet
from mlx_grpo.rollout.decode import generate_rollout
from mlx_grpo.rollout.rollout_records import SamplingParams
from mlx_grpo.training.optimization import accumulate_gradients, loss_weights, make_grad_fn
from mlx_grpo.training.records import StepData

from conftest import interrupt_before_update, run_metrics, same_last_checkpoint

FIXTURES = Path(__file__).parent / "fixtures"
DATA = FIXTURES / "demo_tiny.jsonl"
REWARDS = f"reward_funcs={FIXTURES}/demo_rewards.py:even_answers_pay,{FIXTURES}/demo_rewards.py:tagged"


def make_cfg(model_dir, out, *items):
    base = [f"model_name={model_dir}", f"output_dir={out}", "batch_size=2", "num_generations=4",
            "max_new_tokens=40", "learning_rate=1e-3", "warmup_ratio=0", "log_completions_steps=1",
            "max_prompt_length=96", "system_prompt=", f"dataset_path={DATA}", f"eval_dataset_path={DATA}", REWARDS,
            "demonstrations=zero_groups"]
    return build_config("train", overrides=parse_set(base + list(items)))


def references() -> dict[str, str]:
    """answer -> reference completion of the fixture's examples that have one."""
    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    return {r["answer"]: r["completion"] for r in rows if "completion" in r}


# ----------------------------------------------------------------------------- which groups

def test_groups_without_reward_total_named_and_not_applicable():
    per = {"fmt": np.array([0, 0.5, 0, 0, 0, 0, np.nan, np.nan], np.float32),
           "correct": np.array([0, 0, 0, 0, 0, 1, np.nan, 0], np.float32)}
    total = np.nan_to_num(per["fmt"]) + np.nan_to_num(per["correct"])
    scores = RewardScores(["fmt", "correct"], per, total)
    assert groups_without_reward(scores, 2).tolist() == [False, True, False, True]
    assert groups_without_reward(scores, 2, "correct").tolist() == [True, True, False, True]
    assert groups_without_reward(scores, 2, "fmt").tolist() == [False, True, True, True]
    negative = RewardScores(["p"], {"p": np.array([-1.0, -0.5], np.float32)}, np.array([-1.0, -0.5], np.float32))
    assert groups_without_reward(negative, 2).tolist() == [True]  # a penalty is not a reward earned


def test_injected_only_into_zero_groups_with_a_reference_and_logged(tiny_model_dir, tmp_path):
    """Odd answers earn nothing from a random model: their groups (those with a reference) get the reference as
    their last row, scored by the real rewards; even-answer groups and the odd one without a reference do
    not. demo_fraction is the share of groups that got one; reward_mean covers the sampled rows only."""
    run = run_mod.train(make_cfg(tiny_model_dir, tmp_path))
    refs = references()
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    records = run_metrics(run)
    assert len(records) == 4 and len(rows) == 4 * 8
    seen = set()
    for update in range(1, 5):
        mine = [r for r in rows if r["update_step"] == update]
        demo_groups = 0
        for g in range(2):
            group = mine[4 * g:4 * g + 4]
            answer = group[0]["answer"]
            seen.add(answer)
            gets_one = int(answer) % 2 == 1 and answer in refs
            assert [r["demo"] for r in group] == [False, False, False, gets_one]  # the LAST row, only there
            if gets_one:
                demo_groups += 1
                demo = group[-1]
                assert demo["completion"] == refs[answer] and demo["reward"] == 1.0
                assert demo["rewards"] == {"even_answers_pay": 0.0, "tagged": 1.0}
                # the group's advantages are computed with it: [0, 0, 0, 1] -> 1.5 and -0.5 (std ddof=1)
                assert demo["advantage"] == pytest.approx(1.5, abs=1e-3)
                assert all(r["advantage"] == pytest.approx(-0.5, abs=1e-3) for r in group[:3])
            elif int(answer) % 2:  # no reference: nothing to inject, a flat group
                assert all(r["advantage"] == 0 for r in group)
        record = records[update - 1]
        assert record["demo_fraction"] == demo_groups / 2
        assert record["reward_mean"] == pytest.approx(
            np.mean([0.5 if int(r["answer"]) % 2 == 0 else 0.0 for r in mine]))  # the sampled rows' rewards
    assert "15" in seen and any(r["demo_fraction"] > 0 for r in records)  # both cases really occurred


def test_named_reward_and_off(tiny_model_dir, tmp_path):
    """demo_reward = tagged: every group lacks it (a random model never writes <answer>), so every group with a
    reference gets one; demonstrations = off leaves no trace in the logs."""
    run = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=named", "demo_reward=tagged",
                                 "max_train_samples=4"))
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    refs = references()
    for g in range(0, len(rows), 4):
        assert rows[g + 3]["demo"] == (rows[g]["answer"] in refs)
    off = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=off", "demonstrations=off",
                                 "max_train_samples=4"))
    assert "demo_fraction" not in run_metrics(off)[0]
    assert all("demo" not in json.loads(line) for line in (off / "completions.jsonl").read_text().splitlines())


# ----------------------------------------------------------------------------- the demonstration row

def _tokenizer(tiny_model_dir):
    from mlx_lm import load

    return load(str(tiny_model_dir))


def test_demonstration_row_tokens_masks_and_widening(tiny_model_dir):
    model, tok = _tokenizer(tiny_model_dir)
    prompts = [tok.encode("q one"), tok.encode("q two")]
    r = generate_rollout(model, tok, prompts, 3, SamplingParams(6, 1.0), mx.random.key(0))
    ids = tok.encode("12 <answer>", add_special_tokens=False) + [2]
    out = with_demonstrations(r, {2: ids}, {2: "12 <answer>"}, pad_id=0)
    assert out.completion_ids.shape == (6, len(ids)) and len(ids) > 6  # widened to the demonstration
    assert out.completion_ids[2].tolist() == ids and out.mask[2].tolist() == [1.0] * len(ids)
    assert out.sampler_logprobs[2].tolist() == [0.0] * len(ids) and not out.truncated[2]
    assert out.demo.tolist() == [False, False, True, False, False, False] and out.texts[2] == "12 <answer>"
    assert out.prompt_ids == r.prompt_ids  # the prompt is context, never in the mask
    for row in (0, 1, 3, 4, 5):  # the sampled rows are untouched, padded with mask 0
        n = int(r.mask[row].sum().item())
        assert out.completion_ids[row, :6].tolist() == r.completion_ids[row].tolist()
        assert out.mask[row].tolist() == r.mask[row].tolist() + [0.0] * (len(ids) - 6)
        assert out.sampler_logprobs[row, :n].tolist() == r.sampler_logprobs[row, :n].tolist()


def _demonstrator(tiny_model_dir, tmp_path, *items):
    model, tok = _tokenizer(tiny_model_dir)
    cfg = make_cfg(tiny_model_dir, tmp_path, "num_generations=2", *items)
    rewards = RewardSet([n for n in cfg.rewards.reward_funcs])
    printed = []
    return Demonstrator(cfg, tok, rewards, 0, printed.append), printed, model, tok


def test_prefill_is_stripped_long_references_are_skipped_and_mismatches_refused(tiny_model_dir, tmp_path):
    demo, printed, model, tok = _demonstrator(tiny_model_dir, tmp_path, "prefill=Sure:", "max_new_tokens=24")
    ex = [Example("q", "3", {"completion": "Sure:<answer>3</answer>"}), Example("q", "5", {"completion": "Sure:" + "x" * 40})]
    r = generate_rollout(model, tok, [tok.encode("q"), tok.encode("q")], 2, SamplingParams(4, 1.0), mx.random.key(0))
    names = ["even_answers_pay", "tagged"]
    zero = RewardScores(names, {n: np.zeros(4, np.float32) for n in names}, np.zeros(4, np.float32))
    out, scores = demo.inject(ex, r, zero)
    assert out.demo.tolist() == [False, True, False, False]  # the 40-token reference does not fit
    assert out.completion_ids[1, :int(out.mask[1].sum().item())].tolist() == \
        tok.encode("<answer>3</answer>", add_special_tokens=False) + [2]  # after the prefill, then the end token
    assert out.texts[1] == "Sure:<answer>3</answer>" and scores.per_func["tagged"].tolist() == [0, 1, 0, 0]
    assert len(printed) == 1 and "exceeds max_new_tokens" in printed[0]
    demo.inject(ex, r, zero)
    assert len(printed) == 1  # once
    with pytest.raises(UserError, match="does not begin with the prefill"):
        demo.inject([Example("q", "3", {"completion": "<answer>3</answer>"})] * 2, r, zero)


def test_demonstrations_that_can_never_apply_are_refused_before_the_model_loads(tmp_path, capsys):
    """Data without reference solutions: demonstrations could never apply (the run would end with
    demo_fraction 0 and nothing said). One line, exit 2, before the model loads (it does not exist here), and
    no run directory is written."""
    from mlx_grpo.commands.cli import main

    data = tmp_path / "plain.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(4)))
    argv = ["train", "--set", f"model_name={tmp_path / 'no-model'}", "--set", f"dataset_path={data}", "--set",
            f"output_dir={tmp_path / 'runs'}", "--set", "demonstrations=zero_groups", "--set", "batch_size=2"]
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == ("mlx-grpo train: error: demonstrations = zero_groups, but none of the 4 training examples has a "
                    "reference solution to demonstrate (a 'completion' or 'solution' column, or GSM8K's or arith's "
                    "worked solution), so no group could ever get one: use data with such a column, or set "
                    "demonstrations = off")
    assert not (tmp_path / "runs").exists()


def test_references_are_checked_at_start(tiny_model_dir, tmp_path):
    """Some examples without a reference: a note naming how many; a reference the prefill does not open: refused
    at start rather than at the first group that needs it."""
    from mlx_grpo.data.demonstrations import check_references
    from mlx_grpo.data.examples import load_file

    examples = load_file(DATA)
    missing = len(examples) - len(references())
    assert missing > 0
    assert check_references(make_cfg(tiny_model_dir, tmp_path), examples) == (
        f"[mlx-grpo] note: no reference solution in {missing} of the {len(examples)} training examples: their groups "
        "never get a demonstration")
    assert check_references(make_cfg(tiny_model_dir, tmp_path), [e for e in examples if "completion" in e.columns]) \
        is None
    with pytest.raises(UserError, match="does not begin with the prefill 'Sure:'"):
        check_references(make_cfg(tiny_model_dir, tmp_path, "prefill=Sure:"), examples)


@pytest.mark.parametrize("items,match", [
    (["demo_reward=correctness"], "demo_reward must name one of the run's rewards"),
    (["demonstrations=always"], "demonstrations must be one of off, zero_groups"),
    (["demonstrations=off", "demo_reward=tagged"], "demo_reward only applies with demonstrations on"),
    (["tools=calculator"], "demonstrations need single-turn rollouts"),
])
def test_bad_settings_are_one_line(tiny_model_dir, tmp_path, items, match):
    with pytest.raises(UserError, match=match):
        make_cfg(tiny_model_dir, tmp_path, *items)


# ----------------------------------------------------------------------------- the objective

def naive_mixed_loss(logp, old, ref, sampler, adv, mask, demo, row_w, eps, beta, cap):
    """sum_n row_w[n] * sum_t mask * -(w * min(rho * A, clip(rho, 1 - eps, 1 + eps) * A) - beta * k3), with
    rho = exp(logp - old) for every row (old: the rollout policy, teacher-forced on a demonstration), and w the
    token_truncate weight min(exp(old - sampler), cap) of a sampled row, 1 for a demonstration. Also the
    sampler figures over the sampled rows' tokens only: (k3 sum, max |old - sampler|, tokens). Plain loops."""
    total, skl, dmax, count = 0.0, 0.0, 0.0, 0
    for n in range(len(logp)):
        for t in range(len(logp[n])):
            if mask[n][t] == 0:
                continue
            rho = math.exp(logp[n][t] - old[n][t])
            a = adv[n]
            pg = min(rho * a, min(max(rho, 1 - eps), 1 + eps) * a)
            w = 1.0 if demo[n] else min(math.exp(old[n][t] - sampler[n][t]), cap)
            d = ref[n][t] - logp[n][t]
            total += row_w[n] * -(w * pg - beta * (math.exp(d) - d - 1))
            if not demo[n]:
                s = old[n][t] - sampler[n][t]
                skl, dmax, count = skl + math.exp(s) - s - 1, max(dmax, abs(s)), count + 1
    return total, skl, dmax, count


def test_objective_on_mixed_rows_matches_naive_loss_and_gradient():
    rng = np.random.default_rng(0)
    N, T = 6, 5
    old = rng.uniform(-5.0, -0.3, size=(N, T))
    logp = old + rng.choice([-0.5, -0.1, 0.0, 0.1, 0.4], size=(N, T)) + rng.uniform(-0.02, 0.02, (N, T))
    ref = logp + rng.normal(scale=0.3, size=(N, T))
    sampler = old - rng.normal(scale=0.5, size=(N, T))  # some weights pass the cap
    sampler[[2, 5]] = 0.0  # demonstrations carry no sampler log-prob: a weight exp(old) if it were used
    adv = np.array([-0.5, -0.5, 1.0, 0.3, -1.2, 1.5])
    mask = (np.arange(T)[None] < np.array([5, 3, 4, 2, 5, 1])[:, None]).astype(np.float64)
    demo = np.array([False, False, True, False, False, True])
    row_w = 1.0 / (mask.sum(1) * N)
    obj = Objective(clip_low=0.2, clip_high=0.2, kl_coeff=0.04, rollout_correction="token_truncate", rollout_cap=1.5)
    f = lambda a: mx.array(np.asarray(a, np.float32))  # noqa: E731

    def loss(lp):
        return objective_sums(lp, f(old), f(ref), f(adv), f(mask), f(row_w), obj, f(sampler), f(~demo))

    sums = loss(f(logp))
    c = [a.astype(np.float32).astype(np.float64).tolist() for a in (logp, old, ref, sampler)]
    expected, skl, dmax, count = naive_mixed_loss(*c, adv, mask, demo, row_w, 0.2, 0.04, 1.5)
    assert sums.loss.item() == pytest.approx(expected, rel=1e-5)
    assert sums.sampler_kl.item() == pytest.approx(skl, rel=1e-4) and sums.sampled_tokens.item() == count
    assert sums.sampler_diff_max.item() == pytest.approx(dmax, rel=1e-5) and sums.tokens.item() == mask.sum()
    grad = np.array(mx.grad(lambda lp: loss(lp).loss)(f(logp)), np.float64)
    h = 1e-6
    for n, t in [(0, 0), (1, 2), (2, 0), (2, 3), (3, 1), (4, 4), (5, 0), (5, 3)]:  # demos and sampled rows
        plus, minus = [np.array(c[0]) for _ in range(2)]
        plus[n, t] += h
        minus[n, t] -= h
        fd = (naive_mixed_loss(plus.tolist(), *c[1:], adv, mask, demo, row_w, 0.2, 0.04, 1.5)[0]
              - naive_mixed_loss(minus.tolist(), *c[1:], adv, mask, demo, row_w, 0.2, 0.04, 1.5)[0]) / (2 * h)
        assert grad[n, t] == pytest.approx(fd, rel=1e-3, abs=1e-7), (n, t)
    assert abs(grad[2, 0]) > 1e-4  # the demonstration's token is trained


@pytest.mark.parametrize("compiled", [False, True])
def test_model_gradient_on_mixed_rows_matches_naive(tiny_model_dir, tmp_path, compiled):
    """The trainer's passes (packing, micro-batches, compiled or not) on a step with a demonstration row equal
    a per-row forward of prompt + completion and the formula, written here without the trainer's code."""
    model, tok = _tokenizer(tiny_model_dir)
    cfg = make_cfg(tiny_model_dir, tmp_path, "num_generations=3", "rollout_correction=token_truncate",
                   "rollout_correction_cap=1.5", "kl_coeff=0.04", "micro_batch_size=2", f"use_compile={compiled}")
    prompts = [tok.encode("q one"), tok.encode("q two!")]
    r = generate_rollout(model, tok, prompts, 3, SamplingParams(6, 1.0), mx.random.key(3))
    demo_tokens = tok.encode("7 <answer>7</answer>", add_special_tokens=False) + [2]
    r = with_demonstrations(r, {2: demo_tokens}, {2: "7 <answer>7</answer>"}, pad_id=0)
    N, T = r.completion_ids.shape
    rng = np.random.default_rng(1)
    ids, mask = np.array(r.completion_ids), np.array(r.mask, np.float64)
    lengths = mask.sum(1).astype(int)

    def naive_logprobs(m) -> list[mx.array]:  # one unpadded forward per row
        out = []
        for n in range(N):
            seq = prompts[n // 3] + ids[n, :lengths[n]].tolist()
            logits = m(mx.array([seq]))[0, len(prompts[n // 3]) - 1:-1]  # the logits that predict each token
            out.append(mx.take_along_axis(nn.log_softmax(logits.astype(mx.float32), -1),
                                          mx.array(ids[n, :lengths[n]])[:, None], -1)[:, 0])
        return out

    current = [np.array(x, np.float64) for x in naive_logprobs(model)]
    pad = lambda rows: np.stack([np.pad(x, (0, T - len(x))) for x in rows]).astype(np.float32)  # noqa: E731
    old = pad([x + rng.uniform(-0.3, 0.3, len(x)) for x in current])  # ratios away from 1: clipping acts
    ref = pad([x + rng.normal(scale=0.2, size=len(x)) for x in current])
    sampler = pad([x + rng.normal(scale=0.4, size=len(x)) for x in current]) * (~r.demo)[:, None]
    adv = np.array([0.4, -1.1, 1.6, 0.0, 0.9, -0.7], np.float32)
    r = dataclasses.replace(r, sampler_logprobs=mx.array(sampler))
    step = StepData(r, mx.array(adv), mx.array(old), mx.array(ref))
    weights = loss_weights(cfg, [step])
    grads, sums = accumulate_gradients(make_grad_fn(cfg, model), [step], weights, cfg.training.micro_batch_size, 0)

    def naive_loss(m):
        total = mx.array(0.0)
        for n, lp in enumerate(naive_logprobs(m)):
            k = int(lengths[n])
            rho = mx.exp(lp - mx.array(old[n, :k]))
            pg = mx.minimum(rho * adv[n], mx.clip(rho, 0.8, 1.2) * adv[n])
            w = mx.ones(k) if r.demo[n] else mx.minimum(mx.exp(mx.array(old[n, :k] - sampler[n, :k])), 1.5)
            d = mx.array(ref[n, :k]) - lp
            total = total + (-(w * pg - 0.04 * (mx.exp(d) - d - 1))).sum() / (k * N)
        return total

    value, expected = nn.value_and_grad(model, naive_loss)(model)
    assert sums.loss.item() == pytest.approx(value.item(), rel=1e-4)
    got, want = dict(tree_flatten(grads)), dict(tree_flatten(expected))
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(np.array(got[k]), np.array(want[k]), rtol=2e-3, atol=2e-6, err_msg=k)
    assert max(float(mx.abs(g).max()) for g in want.values()) > 1e-4  # not a vacuous comparison


# ----------------------------------------------------------------------------- resume

@pytest.mark.parametrize("extra", [[], ["num_iterations=2", "kl_coeff=0.1"]])
def test_resume_with_demonstrations_equals_uninterrupted(tiny_model_dir, tmp_path, monkeypatch, extra):
    full = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=full", "save_steps=2", *extra))
    cfg = make_cfg(tiny_model_dir, tmp_path, "run_name=cut", "save_steps=2", *extra)
    interrupt_before_update(run_mod.train, cfg, monkeypatch, 3 if not extra else 5)
    resumed = run_mod.train(cfg, resume="latest")
    assert run_metrics(resumed) == run_metrics(full)
    assert any(r["demo_fraction"] > 0 for r in run_metrics(full))
    assert (resumed / "completions.jsonl").read_text() == (full / "completions.jsonl").read_text()
    assert same_last_checkpoint(full, resumed)
