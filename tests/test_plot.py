"""`mlx-grpo plot` and the curves at the end of a training run: a valid PNG from synthetic and real run
directories, the panels' content, one-line errors, and no MLX import."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_grpo.base.errors import UserError
from mlx_grpo.commands import train as run_mod
from mlx_grpo.commands.cli import main
from mlx_grpo.config import build_config, parse_set
from mlx_grpo.reporting import plot

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def make_cfg(model_dir, out, *items):
    """A tiny training run (as in test_trainer.py)."""
    base = [f"model_name={model_dir}", f"output_dir={out}", "batch_size=2", "num_generations=4",
            "max_new_tokens=8", "max_train_samples=8", "learning_rate=1e-3", "warmup_ratio=0",
            "log_completions_steps=0", "max_prompt_length=96", "system_prompt="]
    return build_config("train", overrides=parse_set(base + list(items)))


def write_run(run_dir: Path, updates: int = 6, evals: bool = True) -> Path:
    """A run directory with synthetic metrics (some values null, as skipped updates log them)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for u in range(1, updates + 1):
            f.write(json.dumps({
                "update_step": u, "reward_mean": 0.1 * u, "reward/correctness": 0.2 * u,
                "reward/xmlcount": None if u == 2 else 0.05, "kl": None if u == 1 else 0.001 * u,
                "sampler_kl": 1e-4, "entropy": 1.5 - 0.1 * u, "completion_length_mean": 40.0 + u,
                "completion_length_max": 64, "time_step_s": 2.0, "time_rollout_s": 1.2, "time_train_s": 0.6,
                "warnings": {}}) + "\n")
        f.write('{"update_step": 7, "reward_me')  # a line cut short by a killed run
    if evals:
        with open(run_dir / "eval.jsonl", "w") as f:
            for u in (3, 6):
                f.write(json.dumps({"update_step": u, "batch_step": u, "trigger": "eval_every_updates",
                                    "accuracy": u / 10, "accuracy_lenient": u / 8, "format_rate": 0.5,
                                    "num_examples": 10}) + "\n")
    return run_dir


def assert_png(path: Path) -> None:
    from matplotlib.image import imread

    assert path.is_file() and path.read_bytes()[:8] == PNG_SIGNATURE
    image = imread(path)
    assert image.shape[0] > 0 and image.shape[1] > 0


def test_plot_command_writes_a_png(tmp_path, capsys):
    run = write_run(tmp_path / "run")
    assert main(["plot", str(run)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {run / 'curves.png'}"
    assert_png(run / "curves.png")
    out = tmp_path / "elsewhere" / "c.png"
    assert main(["plot", str(run), "--output", str(out)]) == 0
    assert_png(out)


def test_panels_show_every_reward_function_and_skip_nulls(tmp_path):
    run = write_run(tmp_path / "run")
    fig = plot.draw(plot.read_jsonl(run / "metrics.jsonl"), plot.read_jsonl(run / "eval.jsonl"))
    reward, accuracy, kl, entropy, length, timing = fig.axes
    lines = {line.get_label(): line for line in reward.get_lines()}
    assert set(lines) == {"reward_mean (total)", "correctness", "xmlcount"}
    assert list(lines["xmlcount"].get_xdata()) == [1, 3, 4, 5, 6]  # the null at update 2 is skipped
    assert {line.get_label() for line in accuracy.get_lines()} == {"accuracy", "lenient"}
    assert list(accuracy.get_lines()[0].get_ydata()) == [0.3, 0.6]
    assert {line.get_label() for line in kl.get_lines()} == {"kl (to reference)", "sampler_kl"}
    assert list(kl.get_lines()[0].get_xdata()) == [2, 3, 4, 5, 6]
    assert len(entropy.get_lines()) == 1
    assert {line.get_label() for line in length.get_lines()} == {"mean", "max"}
    assert {line.get_label() for line in timing.get_lines()} == {"step", "rollout", "train"}


def test_run_without_eval_or_records_still_draws(tmp_path):
    run = write_run(tmp_path / "run", evals=False)
    fig = plot.draw(plot.read_jsonl(run / "metrics.jsonl"), plot.read_jsonl(run / "eval.jsonl"))
    assert [t.get_text() for t in fig.axes[1].texts] == ["no eval"] and not fig.axes[1].get_lines()
    (run / "metrics.jsonl").write_text("")
    assert_png(plot.plot_run(run))


def test_missing_run_or_metrics_is_one_line(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run directory not found" in err
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no metrics.jsonl in" in err and "Traceback" not in err


def test_missing_matplotlib_names_the_extra(tmp_path, monkeypatch):
    run = write_run(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if not installed
    with pytest.raises(UserError, match=r"pip install matplotlib \(or re-run bash scripts/setup.sh\)"):
        plot.plot_run(run)
    assert not (run / "curves.png").exists()


def test_plot_imports_no_mlx(tmp_path):
    run = write_run(tmp_path / "run")
    code = ("import sys; from mlx_grpo.commands.cli import main; rc = main(['plot', sys.argv[1]]); "
            "assert rc == 0; assert not [m for m in sys.modules if m == 'mlx' or m.startswith('mlx.')]")
    subprocess.run([sys.executable, "-c", code, str(run)], check=True, capture_output=True)
    assert_png(run / "curves.png")


@pytest.mark.curves
def test_training_run_ends_with_summary_and_curves(tiny_model_dir, tmp_path, capsys):
    run = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "max_train_samples=4", "eval_every_updates=2",
                                 "eval_subset_size=2", "eval_max_new_tokens=4"))
    out = capsys.readouterr().out
    assert "[mlx-grpo] summary: 2 updates, wall time " in out
    assert "reward_mean: " in out and " (update 1) -> " in out and " (update 2)\n" in out
    assert "by reward function (mean, share of completions credited; first -> last updates):" in out
    assert "last eval (update 2): accuracy " in out
    assert f"final checkpoint: {run / 'checkpoint-2'}" in out
    assert f"curves: {run / 'curves.png'}" in out
    assert out.rstrip().splitlines()[-1].startswith("[mlx-grpo] done: 2 updates")
    assert_png(run / "curves.png")
    fig = plot.draw(plot.read_jsonl(run / "metrics.jsonl"), plot.read_jsonl(run / "eval.jsonl"))
    assert len(fig.axes[0].get_lines()[0].get_xdata()) == 2 and len(fig.axes[1].get_lines()[0].get_xdata()) == 1


@pytest.mark.curves
def test_curves_without_matplotlib_or_failing_never_fail_the_run(tiny_model_dir, tmp_path, capsys, monkeypatch):
    real_find_spec = run_mod.importlib.util.find_spec
    monkeypatch.setattr(run_mod.importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    run = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "max_train_samples=2"))
    out = capsys.readouterr().out
    assert f"curves: mlx-grpo plot {run} (needs matplotlib: pip install matplotlib" in out
    assert not (run / "curves.png").exists()
    monkeypatch.undo()

    def broken(*args, **kwargs):
        raise RuntimeError("no fonts")

    monkeypatch.setattr(plot, "plot_run", broken)
    run = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "max_train_samples=2", "run_name=broken"))
    out = capsys.readouterr().out
    assert f"could not draw the curves (RuntimeError: no fonts); try mlx-grpo plot {run}" in out
    assert "[mlx-grpo] summary: 1 update, wall time" in out and "[mlx-grpo] done: 1 update;" in out  # not "1 updates"
