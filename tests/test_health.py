"""training/health.py on scripted streams: silent-reward lines and the no-signal stop, the plateau and gaming warnings
(each fires where it should and not otherwise), their state surviving a JSON round trip mid-stream, the
prompt-cut report, and the plot's marks of the warnings."""

import json

import numpy as np
import pytest

from mlx_grpo.reporting import plot
from mlx_grpo.training.health import RunHealth, gaming_check, EvalPoint, prompt_cut_report, silence, wilson

NAN = float("nan")


def health(names=("correctness", "format"), stop=10, plateau=3, gaming=3):
    return RunHealth(list(names), stop, plateau, gaming)


def feed(h, stream, start=1):
    """Updates of per-function values; -> [(update, warnings, stop)]."""
    out = []
    for i, per_func in enumerate(stream, start):
        arrays = {k: np.array(v, dtype=np.float32) for k, v in per_func.items()}
        stop = h.observe_update(i, arrays, float(np.mean(np.nansum(list(arrays.values()), axis=0))))
        out.append((i, h.take_warnings(), stop))
    return out


def test_silence_names_none_or_the_one_value():
    assert silence(np.array([NAN, NAN])) == "None"
    assert silence(np.array([0.0, 0.0, NAN])) == "0"
    assert silence(np.array([0.5, 0.5])) == "0.5"
    assert silence(np.array([0.0, 0.5])) is None


def test_silent_reward_lines_and_the_stop():
    h = health(names=("a", "b"), stop=3, plateau=0)
    (_, w1, stop1), (_, w2, stop2) = feed(h, [{"a": [NAN] * 4, "b": [0, 1, 0, 1]},
                                              {"a": [0, 1, 0, 0], "b": [0.5] * 4}])
    assert set(w1) == {"silent_reward/a"} and "returned None for every completion of update 1" in w1["silent_reward/a"]
    assert set(w2) == {"silent_reward/b"} and "returned 0.5 for every completion of update 2" in w2["silent_reward/b"]
    assert "while every completion earns it (learnt already" in w2["silent_reward/b"]  # full marks: not broken
    assert stop1 is None and stop2 is None  # one of them always gave a signal
    # every function silent: counted, the run stops at the third such update in a row
    steps = feed(h, [{"a": [0.0] * 4, "b": [0.5] * 4}] * 3, start=3)
    assert [s for _, _, s in steps][:2] == [None, None]
    assert steps[0][1]["silent_reward/a"].endswith("so this reward teaches nothing yet")  # 0: nothing earned
    (_, penalty, _), = feed(health(names=("a", "b")), [{"a": [-1.0] * 4, "b": [0, 1, 0, 1]}])
    assert penalty["silent_reward/a"].endswith("teaches nothing yet")  # a penalty everyone gets is not "learnt"
    assert "no reward function gave any signal in 3 updates in a row (at update 5: 'a' returned 0, 'b' " \
           "returned 0.5" in steps[2][2] and "max_updates_without_signal = 0" in steps[2][2]
    # every function None: stops at once
    (_, _, stop), = feed(health(stop=10), [{"correctness": [NAN] * 4, "format": [NAN] * 4}])
    assert stop.startswith("no reward function scored any completion of update 1")
    # 0: never stops, the lines still come
    steps = feed(health(stop=0), [{"correctness": [NAN] * 4, "format": [NAN] * 4}] * 30)
    assert all(s is None for _, _, s in steps) and all("silent_reward/format" in w for _, w, _ in steps)


def test_plateau_fires_once_where_one_function_never_pays_while_another_does():
    stream = [{"correctness": [0.0] * 4, "format": [0.0, 0.5, 0.5, 0.0]}] * 6
    fired = [(u, k) for u, w, _ in feed(health(plateau=3), stream) for k in w if k.startswith("plateau")]
    assert fired == [(3, "plateau/correctness")]
    h = health(plateau=3)
    message = feed(h, stream[:3])[-1][1]["plateau/correctness"]
    assert "paid nothing for 3 updates (up to update 3) while format paid" in message
    assert "worked examples" in message and "mlx-grpo sft" in message and "demonstrations" in message


@pytest.mark.parametrize("stream", [
    [{"correctness": [0.0, 2.0, 0.0, 0.0], "format": [0.0, 0.5, 0.5, 0.0]}] * 6,  # both pay
    # correctness pays once every third update: the count restarts each time
    [{"correctness": [0.0, 2.0, 0.0, 0.0] if u % 3 == 0 else [0.0] * 4, "format": [0.5, 0.0, 0.5, 0.0]}
     for u in range(9)],
    [{"correctness": [0.0] * 4, "format": [0.0] * 4}] * 6,  # nobody pays: the stop rule's case, not a plateau
    [{"correctness": [0.0] * 4, "format": [0.5] * 4}] * 2 + [{"correctness": [2.0, 0, 0, 0], "format": [0.5] * 4}],
])
def test_plateau_stays_quiet_otherwise(stream):
    assert not [k for _, w, _ in feed(health(plateau=3, stop=0), stream) for k in w if k.startswith("plateau")]


def test_plateau_needs_another_reward_and_can_be_off():
    stream = [{"correctness": [0.0] * 4}] * 5
    assert not [k for _, w, _ in feed(health(names=("correctness",), plateau=2, stop=0), stream) for k in w
                if k.startswith("plateau")]
    stream = [{"correctness": [0.0] * 4, "format": [0.0, 0.5, 0.5, 0.0]}] * 5
    assert not [k for _, w, _ in feed(health(plateau=0), stream) for k in w if k.startswith("plateau")]


def run_evals(h, rewards_per_interval, accuracies, n=50, per=4):
    """Intervals of `per` updates with the given reward means (a small deterministic wobble), each ended by an
    evaluation; -> the warnings after each evaluation."""
    out, update = [], 0
    for reward, accuracy in zip(rewards_per_interval, accuracies):
        for j in range(per):
            update += 1
            h.observe_update(update, {"correctness": np.array([0.0, 1.0]), "format": np.array([0.0, 0.5])},
                             reward + (0.01 if j % 2 else -0.01))
        h.take_warnings()
        h.observe_eval(update, accuracy, n)
        out.append(h.take_warnings())
    return out


def test_gaming_fires_when_reward_rises_and_accuracy_does_not():
    warned = run_evals(health(gaming=3), [0.2, 0.6, 1.0, 1.1], [0.10, 0.08, 0.12, 0.10])
    assert [bool(w) for w in warned] == [False, False, True, False]  # once, at the third evaluation
    message = warned[2]["gaming"]
    assert "rose from 0.200 (updates up to 4) to 1.000 (updates up to 12) over the last 3 evaluations" in message
    low, high = wilson(0.10, 50)
    assert f"[{low:.3f}, {high:.3f}] on 50 examples" in message and "(evaluation at update 12)" in message


@pytest.mark.parametrize("rewards, accuracies", [
    ([0.2, 0.6, 1.0], [0.10, 0.30, 0.50]),  # accuracy rises with the reward, beyond the first one's interval
    ([0.5, 0.5, 0.5], [0.10, 0.08, 0.10]),  # the reward is flat
    ([0.5, 0.49, 0.51], [0.10, 0.10, 0.10]),  # within the noise of the per-update means
    ([1.0, 0.6, 0.2], [0.10, 0.10, 0.10]),  # it falls
])
def test_gaming_stays_quiet_otherwise(rewards, accuracies):
    assert not any(run_evals(health(gaming=3), rewards, accuracies))


def test_gaming_needs_two_updates_per_interval_and_can_be_off():
    assert not any(run_evals(health(gaming=3), [0.2, 0.6, 1.0], [0.1, 0.1, 0.1], per=1))
    assert not any(run_evals(health(gaming=0), [0.2, 0.6, 1.0], [0.1, 0.1, 0.1]))
    assert gaming_check([EvalPoint(1, 0.1, 50, [0.1, 0.2]), EvalPoint(2, 0.1, 50, [0.9, 1.0])]) is not None


def test_state_survives_a_json_round_trip_mid_stream():
    """What a checkpoint holds: a run resumed from the state warns as the uninterrupted one does."""
    stream = [{"correctness": [0.0] * 4, "format": [0.0, 0.5, 0.5, 0.0]}] * 6
    whole = health(plateau=4)
    expected = feed(whole, stream)
    first = health(plateau=4)
    head = feed(first, stream[:2])
    resumed = health(plateau=4)
    resumed.load_state(json.loads(json.dumps(first.state())))
    assert head + feed(resumed, stream[2:], start=3) == expected
    fresh = health(plateau=4)  # without the state the plateau would come two updates late
    assert head + feed(fresh, stream[2:], start=3) != expected


@pytest.mark.parametrize("lengths, limit, warn, error", [
    ([10, 20, 30], 64, None, None),
    ([10, 100, 120], 64, r"cuts 67% of the prompts from the left \(median 110 tokens -> 64; 0 lose more than half\)"
                         r": raise max_prompt_length to 120", None),
    ([100, 150, 30], 64, r"cuts 67% .*1 lose more than half", None),
    ([200, 300, 30], 64, None, r"max_prompt_length = 64 would cut more than half of the tokens of 67% of the "
                               r"prompts \(median 250 tokens -> 64\), removing their question: set "
                               r"max_prompt_length = 300 \(fits every prompt\)"),
])
def test_prompt_cut_report(lengths, limit, warn, error):
    import re

    w, e = prompt_cut_report(lengths, limit)
    assert (w is None) == (warn is None) and (e is None) == (error is None)
    assert warn is None or re.search(warn, w), w
    assert error is None or re.search(error, e), e


def test_plot_marks_the_update_where_a_warning_fired():
    metrics = [{"update_step": u, "reward_mean": 0.1 * u, "reward/correctness": 0.0,
                "warnings": {"plateau/correctness": "..."} if u == 3 else {"gaming": "..."} if u == 5 else
                {"silent_reward/correctness": "..."}} for u in range(1, 7)]
    assert plot.warning_marks(metrics) == [(3.0, "plateau/correctness"), (5.0, "gaming")]
    fig = plot.draw(metrics, [{"update_step": 5, "accuracy": 0.1, "accuracy_lenient": 0.1}])
    reward, accuracy = fig.axes[:2]
    marks = {line.get_label(): list(line.get_xdata()) for line in reward.get_lines()}
    assert marks["plateau/correctness"] == [3.0, 3.0] and marks["gaming"] == [5.0, 5.0]
    assert [line.get_label() for line in accuracy.get_lines()][-1] == "gaming"


def test_a_training_run_warns_of_the_plateau_once_in_console_and_metrics(tiny_model_dir, tmp_path, capsys):
    """A random model never writes <answer>: correctness never pays while share_of_even_ids does."""
    from pathlib import Path

    from mlx_grpo.commands import train as run_mod
    from mlx_grpo.config import build_config, parse_set

    toy = Path(__file__).parent / "fixtures" / "toy_rewards.py"
    cfg = build_config("train", overrides=parse_set([
        f"model_name={tiny_model_dir}", f"output_dir={tmp_path}", "batch_size=2", "num_generations=4",
        "max_new_tokens=8", "max_train_samples=8", "max_prompt_length=256", "system_prompt=", "plateau_updates=2",
        f"reward_funcs={toy}:share_of_even_ids,correctness"]))
    run = run_mod.train(cfg)
    out = capsys.readouterr().out
    assert out.count("plateau: reward 'correctness' has paid nothing for 2 updates (up to update 2) while "
                     "share_of_even_ids paid") == 1 and "WARNING (update 2): plateau" in out
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["update_step"] for r in rows if "plateau/correctness" in r["warnings"]] == [2]
    assert plot.warning_marks(rows) == [(2.0, "plateau/correctness")]


def test_silent_reward_lines_are_printed_when_they_say_something_new_not_every_ten_updates(tmp_path, capsys):
    from mlx_grpo.reporting.logs import RunLogger

    logger = RunLogger(tmp_path, enabled=False)
    for u in range(1, 61):
        warnings = {"zero_std": "z"}
        returned = 0 if u < 30 else 0.5
        # cleared at 26 and 28, back at 27 and 29 saying the same; at 30 another value; gone for updates 41-50
        # (WARN_EVERY), back at 51 with the same value: a real return, said again
        if u not in (26, 28) and not 41 <= u <= 50:
            warnings["silent_reward/correctness"] = f"reward 'correctness' returned {returned} ... update {u}"
        logger.warn({"update_step": u, "warnings": warnings})
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines if "correctness" in line] == [
        "[mlx-grpo] WARNING (update 1)", "[mlx-grpo] WARNING (update 30)", "[mlx-grpo] WARNING (update 51)"]
    assert "returned 0.5" in [line for line in lines if "correctness" in line][1]
    assert sum(line.endswith(": z") for line in lines) == 6  # other conditions: again every WARN_EVERY updates


def test_a_training_run_warns_of_gaming_after_the_evaluation_that_shows_it(tiny_model_dir, tmp_path, capsys):
    """A reward that pays more at every call (inline rewards: one call per batch step) while the random
    model's eval accuracy stays 0: the evaluation at update 4 closes the second window; its update record
    carries the warning, the plot marks it."""
    from mlx_grpo.commands import train as run_mod
    from mlx_grpo.config import build_config, parse_set

    (tmp_path / "rising.py").write_text(
        "calls = []\n"
        "def rising(prompts, completions, completion_ids, **k):\n"
        "    calls.append(1)\n"
        "    return [len(calls) + 0.1 * (i % 2) for i in range(len(completions))]\n")
    cfg = build_config("train", overrides=parse_set([
        f"model_name={tiny_model_dir}", f"output_dir={tmp_path}", "batch_size=2", "num_generations=4",
        "max_new_tokens=8", "max_train_samples=8", "max_prompt_length=256", "system_prompt=",
        f"reward_funcs={tmp_path / 'rising.py'}:rising", "eval_every_updates=2", "eval_subset_size=2",
        "eval_max_new_tokens=4", "gaming_evals=2"]))
    run = run_mod.train(cfg)
    out = capsys.readouterr().out
    assert out.count("gaming: the training reward rose from 1.550 (updates up to 2) to 3.550 (updates up to 4) "
                     "over the last 2 evaluations while eval accuracy did not (0.000 -> 0.000") == 1
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["update_step"] for r in rows if "gaming" in r["warnings"]] == [4]
    assert plot.warning_marks(rows) == [(4.0, "gaming")]


def test_a_run_that_earns_every_reward_on_every_sample_ends_as_done_not_as_an_error():
    # every function silent at one nonzero value: solved, no stop line; a 0 among them stays an error
    steps = feed(health(names=("a", "b"), stop=3, plateau=0), [{"a": [2.0] * 4, "b": [0.5] * 4}] * 3)
    assert [s for _, _, s in steps] == [None, None, None]
    h = health(names=("a", "b"), stop=3, plateau=0)
    feed(h, [{"a": [2.0] * 4, "b": [0.5] * 4}] * 3)
    assert "every completion earned the same rewards in 3 updates in a row" in h.s.solved
    assert "'a' returned 2, 'b' returned 0.5" in h.s.solved
    stuck = health(names=("a", "b"), stop=3, plateau=0)
    *_, (_, _, stop) = feed(stuck, [{"a": [0.0] * 4, "b": [0.5] * 4}] * 3)
    assert stop and not stuck.s.solved
    # a negative constant (every answer penalised) or a streak that began unpaid is no success
    assert not feed_solved([{"a": [-1.0] * 4, "b": [-1.0] * 4}] * 3)
    assert not feed_solved([{"a": [0.0] * 4, "b": [0.5] * 4}] + [{"a": [2.0] * 4, "b": [0.5] * 4}] * 2)
    # a resumed run decides again (max_updates_without_signal may have changed), its streak kept
    again = health(names=("a", "b"), stop=3, plateau=0)
    again.load_state(h.state())
    assert not again.s.solved and again.s.paid_streak == 3


def feed_solved(stream) -> bool:
    h = health(names=("a", "b"), stop=3, plateau=0)
    feed(h, stream)
    return bool(h.s.solved)


def test_sampler_mismatch_warns_on_the_mean_the_largest_token_or_a_nan():
    """An update whose sampler log-probs differ from the trainer's by >= SAMPLER_KL_ALARM nats a sampled token on
    average (a bfloat16 sampling copy logs ~0.001), or by >= SAMPLER_DIFF_ALARM on one token (healthy: under 2;
    rows decoded on a wrong cache: 7.9-18.9), or by NaN, carries the warning with its figures and the check to run;
    a healthy or unmeasured update does not."""
    from mlx_grpo.config import build_config, parse_set
    from mlx_grpo.reporting.logs import SAMPLER_DIFF_ALARM, SAMPLER_KL_ALARM, diagnose

    cfg = build_config("train")
    quiet = {"zero_std_fraction": 0.0, "truncated_fraction": 0.0}
    for kl, worst in ((None, None), (0.0, 0.0), (0.0014, 1.61), (SAMPLER_KL_ALARM * 0.99, SAMPLER_DIFF_ALARM * 0.99)):
        assert "sampler_mismatch" not in diagnose({**quiet, "sampler_kl": kl, "sampler_diff_max": worst}, cfg)
    said = diagnose({**quiet, "sampler_kl": 0.31, "sampler_diff_max": 12.5}, cfg)["sampler_mismatch"]
    assert "sampler_kl 0.310 nats per sampled token, largest token difference 12.50" in said
    assert "bench/sampler_check.py" in said and "async_rollouts, carry_surplus" in said
    # dropout in the gradient pass moves every token's log-prob: not a mismatch to report
    dropout = build_config("train", overrides=parse_set(["train_type=lora", "lora_dropout=0.1"]))
    assert "sampler_mismatch" not in diagnose({**quiet, "sampler_kl": 0.31, "sampler_diff_max": 12.5}, dropout)
    for kl, worst in ((SAMPLER_KL_ALARM, 1.0), (0.002, SAMPLER_DIFF_ALARM), (float("nan"), None), (0.001, float("nan")),
                      (None, 8.0)):
        assert "sampler_mismatch" in diagnose({**quiet, "sampler_kl": kl, "sampler_diff_max": worst}, cfg), (kl, worst)
