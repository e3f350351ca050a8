"""Dynamic sampling in waves (training/sampling.py Sampling.waves): the draws a batch step needs, decoded
together in as few passes as the varied-group rate allows, train on exactly the groups of the sequential
rule (one draw at a time until batch_size groups vary, at most max_resample_batches more), written here from
its definition; the wave estimate survives a resume."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from mlx_grpo.commands import assembly as assembly_mod
from mlx_grpo.commands import train as run_mod
from mlx_grpo.config import build_config, parse_set
from mlx_grpo.training.draws import RATE_WINDOW, wave_size
from mlx_grpo.training.job import Job
from mlx_grpo.training.sampling import Sampling, TextPrompts

from conftest import begin_widths, interrupt_before_update, run_metrics, same_last_checkpoint

TOY = Path(__file__).parent / "fixtures" / "toy_rewards.py"
RATES = {  # reward -> how many of the groups vary
    "all": f"reward_funcs={TOY}:share_of_even_ids",  # every completion's share of even ids differs
    "none": "reward_funcs=int",  # a random model never writes an integer answer: every group scores 0
    "half": f"reward_funcs={TOY}:flat_unless_even_answer",  # groups of odd-answer questions are flat
}


def make_cfg(model_dir, out, *items):
    base = [f"model_name={model_dir}", f"output_dir={out}", "batch_size=4", "num_generations=4",
            "max_new_tokens=8", "max_train_samples=64", "learning_rate=1e-2", "warmup_ratio=0",
            "log_completions_steps=0", "max_prompt_length=96", "system_prompt=", "dynamic_sampling=true",
            "max_resample_batches=3", "draws_per_pass=4", "save_steps=0"]
    return build_config("train", overrides=parse_set(base + list(items)))


def quarter_reward(tmp_path: Path) -> str:
    """A reward whose groups vary only for questions whose answer is a multiple of 4 (about a quarter)."""
    path = tmp_path / "quarter.py"
    path.write_text("def quarter(prompts, completions, completion_ids, answer, **columns):\n"
                    "    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) if int(a) % 4 == 0 else 0.5\n"
                    "            for ids, a in zip(completion_ids, answer)]\n")
    return f"reward_funcs={path}:quarter"


def sequential_batch_step(s: Sampling, examples):
    """The rule, one draw (one decode) at a time: draw, and while fewer than batch_size groups vary, draw
    again, at most max_resample_batches more times or until the data runs out."""
    cfg = s.cfg
    draws = [s.draw(examples)]
    while sum(int(s.flags(d).sum()) for d in draws) < cfg.training.batch_size \
            and len(draws) < 1 + cfg.rollout.max_resample_batches:
        more = s.next_examples()
        if more is None:
            break
        draws.append(s.draw(more))
    return s.logprob_passes(draws)


def position(s: Sampling) -> tuple[dict, dict]:
    return s.data.state(), copy.deepcopy(vars(s.counters))


def go_to(s: Sampling, where: tuple[dict, dict]) -> None:
    s.rewind_data(where[0])
    vars(s.counters).update(copy.deepcopy(where[1]))


def same_rows(a, b) -> None:
    for name in ("completion_ids", "mask", "sampler_logprobs", "truncated", "lengths"):
        np.testing.assert_array_equal(np.array(getattr(a, name)), np.array(getattr(b, name)), err_msg=name)
    assert list(a.texts) == list(b.texts)


@pytest.mark.run  # a few seconds each: tiny models, but 2 x 6 batch steps of up to 4 draws
@pytest.mark.parametrize("engine", ["copy", "model", "copy-wide"])
@pytest.mark.parametrize("rate", ["all", "none", "half"])
def test_waves_train_on_the_groups_of_the_sequential_rule(tiny_model_dir, tmp_path, rate, engine, monkeypatch):
    """Batch step after batch step of one run, the wave schedule and the sequential rule, each from the same
    position (draw counter, data cursor, weights), train on the same examples, completions, rewards and
    advantages; the waves take fewer decode passes when groups are scarce. copy-wide: a pass's draws start
    together in one batch of running_rows (4 draws x 16 rows) rather than taking freed slots."""
    wide = ["running_rows=64"] if engine == "copy-wide" else []
    cfg = make_cfg(tiny_model_dir, tmp_path, RATES[rate], f"rollout_engine={engine.split('-')[0]}", *wide)
    job = assembly_mod.build_job(cfg)
    s, t = job.sampling, job.trainer
    assert s.policies.engine.rows == (64 if wide else 0)
    began = begin_widths(monkeypatch)  # the rows each decode starts with
    decodes, calls = [], []  # draws per decode: this batch step's waves; every decode of the test
    original = TextPrompts.generate
    s.prompts.generate = lambda policies, jobs, params: decodes.append(len(jobs)) or calls.append(len(jobs)) or \
        original(s.prompts, policies, jobs, params)
    cap = 1 + cfg.rollout.max_resample_batches
    steps = draws = passes = surplus = 0
    for _ in range(6):
        start = position(s)
        examples = s.next_examples()
        if examples is None:
            break
        decodes.clear()
        waves = s.batch_step(examples)
        assert waves.stats.decode_passes == len(decodes) and sum(decodes) == len(waves.draws)
        after = position(s)
        go_to(s, start)
        reference = sequential_batch_step(s, s.next_examples())
        go_to(s, after)
        got, want = t.score(waves), t.score(reference)
        assert len(reference.draws) <= len(waves.draws) <= cap
        for w, r in zip(waves.draws, reference.draws):  # the same draws, decoded together or one by one
            assert [e.prompt for e in w.examples] == [e.prompt for e in r.examples]
            same_rows(w.rollout, r.rollout)
        assert [(e.prompt, e.answer) for e in waves.stats.examples] == \
            [(e.prompt, e.answer) for e in reference.stats.examples]
        same_rows(got.rollout, want.rollout)
        np.testing.assert_array_equal(waves.stats.rewards, reference.stats.rewards)
        np.testing.assert_array_equal(np.array(got.advantages), np.array(want.advantages))
        steps, draws, passes = steps + 1, draws + len(waves.draws), passes + waves.stats.decode_passes
        surplus += len(waves.draws) - len(reference.draws)
        assert len(s.counters.varied_recent) == min(draws, RATE_WINDOW)
    assert steps >= 3
    if engine != "model":  # a decode of several draws starts them all with running_rows, one draw's 16 rows without
        assert began == [16 * n if wide else 16 for n in calls] and (max(calls) > 1) == (rate != "all")
    if rate == "all":  # one draw of batch_size varied groups each time: one pass each, nothing drawn to spare
        assert draws == passes == steps and surplus == 0
    elif rate == "none":  # every batch step takes the cap; after the first, in one pass
        assert draws == cap * steps and passes == steps + 1 and surplus == 0
    else:
        assert passes < draws


def test_wave_size_follows_the_rate_within_the_cap():
    assert wave_size([], 4, 4) == 1  # nothing measured: one draw
    assert wave_size([0, 0], 4, 3) == 3  # nothing varied lately: all the draws left
    assert wave_size([4, 4], 4, 4) == 1
    assert wave_size([2, 2], 4, 4) == 2 and wave_size([2, 1], 4, 4) == 3  # ceil(4 / 1.5)
    assert wave_size([1, 0, 0, 0], 4, 4) == 4 and wave_size([1, 0, 0, 0], 4, 2) == 2
    assert wave_size([3, 3], 1, 4) == 1  # a small deficit: one draw


def test_low_rate_runs_take_fewer_decode_passes_than_draws(tiny_model_dir, tmp_path, capsys):
    """At about a quarter of the groups varied, an update's draws decode in fewer passes than draws, and the
    record says how many, with the rows decoded per row trained."""
    calls = []
    original = TextPrompts.generate

    def counted(self, policies, jobs, params):
        calls.append(len(jobs))
        return original(self, policies, jobs, params)

    cfg = make_cfg(tiny_model_dir, tmp_path, quarter_reward(tmp_path), "batch_size=2", "max_train_samples=48")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TextPrompts, "generate", counted)
        rows = run_metrics(run_mod.train(cfg))
    assert len(rows) >= 3
    assert sum(r["decode_passes"] for r in rows) == len(calls) and sum(r["draws"] for r in rows) == sum(calls)
    assert sum(r["decode_passes"] for r in rows) < sum(r["draws"] for r in rows)
    assert max(calls) > 1  # draws decoded together
    for r in rows:
        assert 1 <= r["decode_passes"] <= r["draws"] <= 4
        want = r["draws"] * 2 / r["groups_trained"] if r["groups_trained"] else None
        assert r["rows_decoded_per_trained"] == pytest.approx(want)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[mlx-grpo] update ")]
    assert lines and f"draws {rows[0]['draws']} in {rows[0]['decode_passes']} pass" in lines[0]
    plain = run_metrics(run_mod.train(build_config("train", overrides=parse_set(
        [f"model_name={tiny_model_dir}", f"output_dir={tmp_path}", "run_name=plain", "batch_size=2",
         "num_generations=4", "max_new_tokens=8", "max_train_samples=8", "system_prompt=", "save_steps=0",
         "log_completions_steps=0", quarter_reward(tmp_path)]))))
    assert "decode_passes" not in plain[0] and "rows_decoded_per_trained" not in plain[0]
    calls.clear()  # draws_per_pass = 1 (the default): one draw a pass, whatever the rate says
    one = make_cfg(tiny_model_dir, tmp_path, quarter_reward(tmp_path), "batch_size=2", "max_train_samples=48",
                   "draws_per_pass=1", "run_name=one")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TextPrompts, "generate", counted)
        rows = run_metrics(run_mod.train(one))
    assert calls and set(calls) == {1}
    assert all(r["decode_passes"] == r["draws"] for r in rows) and max(r["draws"] for r in rows) > 1


def test_resume_equals_uninterrupted_with_the_wave_estimate(tiny_model_dir, tmp_path, monkeypatch):
    """The rate that sizes the waves is in the checkpoint (the counters): a resumed run makes the same draws in
    the same passes as the uninterrupted one; one that forgot it would not."""
    items = (quarter_reward(tmp_path), "batch_size=2", "max_train_samples=128", "save_steps=2",
             "gradient_accumulation_steps=2")
    full = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=full", *items))
    want = run_metrics(full)
    assert len(want) >= 4 and any(r["decode_passes"] < r["draws"] for r in want[2:])
    state = json.loads((full / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["counters"]["varied_recent"] and len(state["counters"]["varied_recent"]) <= RATE_WINDOW

    cfg = make_cfg(tiny_model_dir, tmp_path, "run_name=cut", *items)
    interrupt_before_update(run_mod.train, cfg, monkeypatch, 3)
    resumed = run_mod.train(cfg, resume="latest")
    assert run_metrics(resumed) == want
    assert same_last_checkpoint(full, resumed)

    restore = Job.restore

    def forgetting(self, *args, **kwargs):
        restore(self, *args, **kwargs)
        self.counters.varied_recent = []

    cfg = make_cfg(tiny_model_dir, tmp_path, "run_name=forgot", *items)
    interrupt_before_update(run_mod.train, cfg, monkeypatch, 3)
    monkeypatch.setattr(Job, "restore", forgetting)
    forgot = run_metrics(run_mod.train(cfg, resume="latest"))
    assert forgot[:2] == want[:2] and forgot[2]["decode_passes"] != want[2]["decode_passes"]
