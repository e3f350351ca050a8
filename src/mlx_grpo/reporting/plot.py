"""`mlx-grpo plot`: a run's curves as one PNG, read from its metrics.jsonl and eval.jsonl.

This module owns reading a run directory's JSONL logs for plotting and drawing the panels (reward per
function, eval accuracy, KL, entropy, completion length, time per update), the updates where a plateau
or gaming warning fired marked on the reward (gaming also on the accuracy) panel. It imports neither MLX nor
matplotlib at module level: matplotlib (a base dependency, slow to import) is imported when a figure is
drawn, and drawn on its Agg canvas (no display, no pyplot state).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from mlx_grpo.base.errors import UserError

# matplotlib is a base dependency: only an environment set up by other means lacks it.
INSTALL_HINT = "pip install matplotlib (or re-run bash scripts/setup.sh)"


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL log; [] when the file is missing. Blank lines and a line cut short (a run
    killed mid-write) are skipped."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def series(records: list[dict], key: str, x: str = "update_step") -> tuple[list[float], list[float]]:
    """(xs, ys) of the records that hold a finite number under both `x` and `key` (nulls skipped)."""
    xs, ys = [], []
    for r in records:
        a, b = r.get(x), r.get(key)
        if _number(a) and _number(b):
            xs.append(float(a))
            ys.append(float(b))
    return xs, ys


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _matplotlib():
    """matplotlib's Figure and Agg canvas, or a UserError saying how to install it."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError(f"plotting needs matplotlib: {INSTALL_HINT}") from None
    return Figure, FigureCanvasAgg


def _panel(ax, title: str, lines: list[tuple[str, tuple[list, list], dict]], ylabel: str = "",
           empty: str = "no data") -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("update", fontsize=8)
    if ylabel:
        ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(True, alpha=0.3)
    drawn = 0
    for label, (xs, ys), style in lines:
        if xs:
            ax.plot(xs, ys, label=label, marker="o" if len(xs) <= 20 else None, markersize=3, **style)
            drawn += 1
    if drawn:
        ax.legend(fontsize=7, loc="best")
    else:
        ax.text(0.5, 0.5, empty, ha="center", va="center", transform=ax.transAxes, fontsize=12, color="gray")


# Warnings given once (training/health.py) whose update the plot marks: a kind's prefix -> its colour.
MARKED_WARNINGS = {"plateau": "C3", "gaming": "C1"}


def warning_marks(metrics: list[dict]) -> list[tuple[float, str]]:
    """(update, kind) of each once-only warning (plateau/<reward>, gaming) in the records' `warnings`."""
    return [(float(r["update_step"]), kind) for r in metrics if _number(r.get("update_step"))
            for kind in (r.get("warnings") or {}) if kind.split("/")[0] in MARKED_WARNINGS]


def _mark(ax, marks: list[tuple[float, str]]) -> None:
    """A dashed vertical line at each warning's update, labelled with its kind."""
    for x, kind in marks:
        ax.axvline(x, color=MARKED_WARNINGS[kind.split("/")[0]], linestyle=":", linewidth=1.5, label=kind)
    if marks:
        ax.legend(fontsize=7, loc="best")


def draw(metrics: list[dict], evals: list[dict], title: str = ""):
    """The figure of a run's records: six panels (reward, eval accuracy, KL, entropy, completion length,
    time per update) against the update step; a panel with nothing to show says so."""
    Figure, FigureCanvasAgg = _matplotlib()
    fig = Figure(figsize=(12, 10))
    FigureCanvasAgg(fig)
    # fixed margins: a layout engine would measure every label first, doubling the drawing time
    axes = fig.subplots(3, 2, gridspec_kw={"left": 0.06, "right": 0.98, "bottom": 0.05, "top": 0.92,
                                           "hspace": 0.4, "wspace": 0.15}).ravel()
    reward_keys = sorted({k for r in metrics for k in r if k.startswith("reward/")})
    total = ("reward_mean (total)", series(metrics, "reward_mean"), {"linewidth": 2, "color": "black"})
    _panel(axes[0], "reward", [total] + [(k[len("reward/"):], series(metrics, k), {"linewidth": 1})
                                         for k in reward_keys])
    _panel(axes[1], "eval accuracy", [("accuracy", series(evals, "accuracy"), {}),
                                      ("lenient", series(evals, "accuracy_lenient"), {"linestyle": "--"})],
           empty="no eval")
    if series(evals, "accuracy")[0]:
        axes[1].set_ylim(-0.02, 1.02)
    marks = warning_marks(metrics)
    _mark(axes[0], marks)
    _mark(axes[1], [m for m in marks if m[1] == "gaming"])
    _panel(axes[2], "KL", [("kl (to reference)", series(metrics, "kl"), {}),
                           ("sampler_kl", series(metrics, "sampler_kl"), {})])
    _panel(axes[3], "entropy", [("entropy (nats/token)", series(metrics, "entropy"), {})])
    _panel(axes[4], "completion length", [("mean", series(metrics, "completion_length_mean"), {"color": "C0"}),
                                          ("max", series(metrics, "completion_length_max"),
                                           {"color": "C0", "alpha": 0.3})], ylabel="tokens")
    _panel(axes[5], "time per update", [("step", series(metrics, "time_step_s"), {"linewidth": 2}),
                                        ("rollout", series(metrics, "time_rollout_s"), {}),
                                        ("train", series(metrics, "time_train_s"), {})], ylabel="s")
    if title:
        fig.suptitle(title, fontsize=12)
    return fig


def plot_run(run_dir: str | Path, output: str | Path | None = None) -> Path:
    """Draw the curves of `run_dir` into one PNG (default RUN_DIR/curves.png); returns its path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run directory not found: {run_dir}")
    if not (run_dir / "metrics.jsonl").is_file():
        raise UserError(f"no metrics.jsonl in {run_dir}: give the run directory of `mlx-grpo train` "
                        "(output_dir/run_name, written with log_jsonl = true)")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    evals = read_jsonl(run_dir / "eval.jsonl")
    last = metrics[-1].get("update_step") if metrics else None
    fig = draw(metrics, evals, f"{run_dir.resolve().name}: {len(metrics)} update records"
               + (f" (last: update {last})" if last is not None else "") + (f", {len(evals)} evals" if evals else ""))
    out = Path(output) if output is not None else run_dir / "curves.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    return out
