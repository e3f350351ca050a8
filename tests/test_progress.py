"""Console and progress of a run: lines through tqdm.write, the pace/ETA line without a bar, the phase in
the bar's description, the evaluation's bar."""

import io
import re

import pytest
from tqdm import tqdm

from mlx_grpo.commands import evaluate
from mlx_grpo.commands import train as run_mod
from mlx_grpo.config import build_config, parse_set
from mlx_grpo.data.examples import load_examples, subset
from mlx_grpo.reporting import logs


def make_cfg(model_dir, out, *items):
    """A tiny training run (as in test_trainer.py)."""
    base = [f"model_name={model_dir}", f"output_dir={out}", "batch_size=2", "num_generations=4",
            "max_new_tokens=8", "max_train_samples=4", "learning_rate=1e-3", "warmup_ratio=0",
            "log_completions_steps=0", "max_prompt_length=96", "system_prompt="]
    return build_config("train", overrides=parse_set(base + list(items)))


@pytest.mark.parametrize("seconds,text", [(0.4, "0s"), (42, "42s"), (250, "4m10s"), (3600 + 5 * 60 + 9, "1h05m")])
def test_duration(seconds, text):
    assert logs.duration(seconds) == text


def test_pace_is_the_mean_time_per_update_times_the_updates_left():
    assert logs.pace(24.6, 2, 20) == "elapsed 25s, 12.3 s/update, ETA 4m06s"


def test_pace_under_a_time_limit_counts_to_the_update_that_crosses_it():
    # 14 minutes of updates, 2 done in 70 s at 35 s each: 770 s left under the limit, 22 updates, the last
    # crossing it; 780 s left would take 23
    assert logs.pace(70.0, 2, 254, limit_s=840.0) == "elapsed 1m10s, 35.0 s/update, ETA 12m50s (max_minutes)"
    assert logs.pace(60.0, 2, 254, limit_s=840.0) == "elapsed 1m00s, 30.0 s/update, ETA 13m00s (max_minutes)"
    assert logs.updates_left(70.0, 2, 254, limit_s=850.0) == (23, True)
    # num_iterations = 3: the limit is checked after a batch's last pass, so the count ends on a multiple of 3
    assert logs.updates_left(70.0, 2, 254, limit_s=850.0, at=2, passes=3) == (25, True)
    assert logs.updates_left(900.0, 4, 254, limit_s=840.0, at=4, passes=3) == (2, True)
    # the data ends first: the limit changes nothing
    assert logs.pace(70.0, 2, 3, limit_s=840.0) == "elapsed 1m10s, 35.0 s/update, ETA 1m45s"
    # past the limit: that update was the last
    assert logs.pace(900.0, 25, 200, limit_s=840.0) == "elapsed 15m00s, 36.0 s/update, ETA 0s (max_minutes)"


def test_summary_names_its_spans():
    lines = logs.summary_lines(12, 12, 75.0, [(u, float(u)) for u in range(1, 13)],
                               {"update_step": 12, "accuracy": 0.5, "accuracy_lenient": 0.625, "num_examples": 8},
                               None)
    assert lines[0] == "[mlx-grpo] summary: 12 updates, wall time 1m15s"
    assert lines[1] == "[mlx-grpo]   reward_mean: 3.000 (mean of updates 1-5) -> 10.000 (mean of updates 8-12)"
    assert lines[2] == "[mlx-grpo]   last eval (update 12): accuracy 0.500, lenient 0.625 on 8 examples"
    resumed = logs.summary_lines(12, 4, 30.0, [(u, 1.0) for u in range(9, 13)], None, None)
    assert resumed[0] == "[mlx-grpo] summary: 12 updates (4 in this session), wall time 30s (this session)"
    assert resumed[1].endswith("1.000 (mean of updates 9-10) -> 1.000 (mean of updates 11-12)")
    assert logs.summary_lines(1, 1, 1.0, [(1, 0.5)], None, None)[1] == "[mlx-grpo]   reward_mean: 0.500 (update 1)"


def test_summary_says_which_reward_function_rose_and_what_eval_will_not_see():
    """The smoke run's case: the total rose through reasoned_format's first tier (more completions
    credited), reasoned_correctness stayed at 0, so `eval` (right answers) shows no gain."""
    def record(u, fmt, credited):
        return {"update_step": u, "reward_mean": fmt, "reward/reasoned_correctness": 0.0,
                "reward/reasoned_format": fmt, "reward_credited/reasoned_correctness": 0.0,
                "reward_credited/reasoned_format": credited}

    records = [record(u, 0.05 + 0.01 * u, 0.2 + 0.05 * u) for u in range(1, 11)]
    lines = logs.summary_lines(10, 10, 60.0, [(r["update_step"], r["reward_mean"]) for r in records], None, None,
                               records)
    assert lines[1] == "[mlx-grpo]   reward_mean: 0.080 (mean of updates 1-5) -> 0.130 (mean of updates 6-10)"
    assert lines[2:] == [
        "[mlx-grpo]   by reward function (mean, share of completions credited; first -> last updates):",
        "[mlx-grpo]     reasoned_correctness: 0.000 -> 0.000, credited 0% -> 0% (flat)",
        "[mlx-grpo]     reasoned_format: 0.080 -> 0.130, credited 35% -> 60% (rose)",
        "[mlx-grpo]   reasoned_correctness did not rise: `mlx-grpo eval` (right answers) will show no gain yet"]
    # a correctness reward that rose: no such line; a function that fell says so
    records = [{"update_step": u, "reward_mean": 0.0, "reward/correctness": u / 10, "reward/xmlcount": 1 - u / 10}
               for u in range(1, 5)]
    assert logs.reward_function_lines(records[:2], records[2:]) == [
        "[mlx-grpo]   by reward function (mean, share of completions credited; first -> last updates):",
        "[mlx-grpo]     correctness: 0.150 -> 0.350 (rose)",
        "[mlx-grpo]     xmlcount: 0.850 -> 0.650 (fell)"]
    # one update: nothing to compare
    assert len(logs.summary_lines(1, 1, 1.0, [(1, 0.5)], None, None, records[:1])) == 2


def test_run_lines_go_through_tqdm_write_with_pace_when_no_bar(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Captured stdout is no terminal: no bar, so each update's line carries the pace and ETA; every run-time
    line (warnings, evals, updates) is written through tqdm.write, which keeps a live bar intact."""
    written = []
    write = tqdm.write
    monkeypatch.setattr(tqdm, "write", classmethod(lambda cls, s, *a, **k: (written.append(s), write(s, *a, **k))))
    run_mod.train(make_cfg(tiny_model_dir, tmp_path, "reward_funcs=int", "eval_every_updates=2",
                           "eval_subset_size=2", "eval_max_new_tokens=4"))
    out = capsys.readouterr().out
    updates = [line for line in out.splitlines() if line.startswith("[mlx-grpo] update ")]
    assert len(updates) == 2
    assert all(re.search(r", elapsed \d+s, \d+\.\d s/update, ETA \d+s$", line) for line in updates)
    assert updates[-1].endswith("ETA 0s")  # nothing left
    for part in ("WARNING (update 1)", "eval at update 2", "[mlx-grpo] update 1:", "summary:", "done: 2 updates"):
        assert any(part in line for line in written), part


def test_bar_shows_the_phase(tiny_model_dir, tmp_path, monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr(run_mod, "tqdm", lambda *a, **k: tqdm(*a, **{**k, "disable": False, "file": buf,
                                                                     "mininterval": 0}))
    run_mod.train(make_cfg(tiny_model_dir, tmp_path, "gradient_accumulation_steps=2", "num_iterations=2",
                           "eval_every_updates=1", "eval_subset_size=1", "eval_max_new_tokens=4"))
    shown = buf.getvalue()
    # the update's two batch steps decode together (refill), then train twice (num_iterations)
    for phase in ("grpo [rollout 1-2/2]", "grpo [train 1/2]", "grpo [train 2/2]", "grpo [eval]"):
        assert phase in shown, phase
    assert shown.rstrip().split("\r")[-1].startswith("grpo: 100%|")  # the closed bar names no phase


@pytest.mark.parametrize("progress", [True, False])
def test_evaluation_bar_over_the_examples(tiny_model_dir, monkeypatch, progress):
    """The bar counts examples as each batch of eval_batch_size is answered; progress=False (the
    non-main ranks) shows none."""
    from mlx_grpo.models.model_loading import load_model

    buf = io.StringIO()
    monkeypatch.setattr(evaluate, "tqdm", lambda *a, **k: tqdm(*a, **{**k, "file": buf, "mininterval": 0,
                                                                      "disable": k["disable"] or False}))
    cfg = build_config("eval", overrides=parse_set([f"model_name={tiny_model_dir}", "eval_batch_size=2",
                                                    "system_prompt="]))
    model, tokenizer = load_model(str(tiny_model_dir))
    examples = subset(load_examples("arith", "test", None, 0), 3, 0)
    records = evaluate.answer_records(model, tokenizer, examples, cfg, max_new_tokens=4, progress=progress)
    assert len(records) == 3
    shown = buf.getvalue()
    assert ("eval:   0%| " in shown and "2/3 [" in shown) is progress  # after the first batch of 2


def test_a_time_limited_run_counts_its_eta_to_the_limit(tiny_model_dir, tmp_path, capsys):
    """max_minutes ends the run long before its data: the update line's ETA is the limit's, and says so."""
    run_mod.train(make_cfg(tiny_model_dir, tmp_path, "reward_funcs=int", "num_epochs=3", "max_minutes=0.000001"))
    updates = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[mlx-grpo] update ")]
    assert len(updates) == 1  # the first update crosses the limit
    assert re.search(r", ETA \d+s \(max_minutes\)$", updates[0]), updates[0]


def test_a_time_limited_run_sizes_its_bar_to_the_limit(tiny_model_dir, tmp_path, monkeypatch):
    """On a terminal the bar's total (and so tqdm's ETA) follows the updates the time limit leaves."""
    buf = io.StringIO()
    monkeypatch.setattr(run_mod, "tqdm", lambda *a, **k: tqdm(*a, **{**k, "disable": False, "file": buf,
                                                                     "mininterval": 0}))
    run_mod.train(make_cfg(tiny_model_dir, tmp_path, "reward_funcs=int", "num_epochs=3", "max_minutes=0.000001"))
    shown = buf.getvalue().rstrip().split("\r")
    assert any("0/6" in part for part in shown)  # the data's count before the first update
    assert shown[-1].startswith("grpo: 100%|") and "1/1 " in shown[-1], shown[-1]  # the limit ended it at 1


def test_without_a_bar_the_first_update_says_each_phase_once(tiny_model_dir, tmp_path, capsys):
    """Logs (no terminal) hear from the first update before its metrics line, which may be minutes away on a
    fresh GPU machine; later updates print only their own line."""
    run_mod.train(make_cfg(tiny_model_dir, tmp_path))
    lines = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith(("[mlx-grpo] update ", "[mlx-grpo] working on "))]
    assert lines[:2] == ["[mlx-grpo] working on update 1: " + run_mod.PHASES["rollout"],
                         "[mlx-grpo] working on update 1: " + run_mod.PHASES["train"]]
    assert lines[2].startswith("[mlx-grpo] update 1: reward ")
    assert lines[3].startswith("[mlx-grpo] update 2: reward ") and len(lines) == 4


def test_a_resumed_runs_summary_covers_every_session(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from conftest import interrupt_before_update

    cfg = make_cfg(tiny_model_dir, tmp_path, "max_train_samples=8", "save_steps=2")
    interrupt_before_update(run_mod.train, cfg, monkeypatch, 3)
    capsys.readouterr()
    run_mod.train(cfg, resume="latest")
    out = capsys.readouterr().out
    assert "summary: 4 updates (2 in this session)" in out
    # the reward trend runs from the first session's updates to the last: 1-2 -> 3-4, not 3 -> 4
    assert re.search(r"reward_mean: \S+ \(mean of updates 1-2\) -> \S+ \(mean of updates 3-4\)", out), out
