"""Overlay one recipe's GRPO runs over seeds: a few metrics per update, one line per run, into one PNG.

`mlx-grpo plot` draws one run; docs/learning.md's per-seed figures need the same metric from several runs
(one per seed) side by side. Reads each run's metrics.jsonl (a run directory, or the file itself as
bench/learning_run.sh copies it) through mlx_grpo.reporting.plot.

    python bench/seed_curves.py -o docs/learning-prod-tools-seeds.png s42=RUN_DIR s7=RUN_DIR s1234=RUN_DIR
    python bench/seed_curves.py --panels correctness,format,kl -o PNG s42=arith-s42.metrics.jsonl ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # from a checkout, as learning_report.py
from mlx_grpo.reporting.plot import read_jsonl, series  # noqa: E402

# name -> (metrics.jsonl key, panel title, scale): reasoned_correctness pays 2.0 for a right answer, so half
# its mean is the share of right completions among those drawn.
PANELS = {
    "correctness": ("reward/reasoned_correctness", "right answers among drawn completions", 0.5),
    "format": ("reward/reasoned_format", "reasoned_format reward", 1.0),
    "draws": ("draws", "batches drawn per update", 1.0),
    "kl": ("kl", "KL to the reference", 1.0),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="LABEL=PATH (a run directory or its metrics.jsonl), one per seed")
    parser.add_argument("-o", "--output", type=Path, required=True)
    parser.add_argument("--title", default="")
    parser.add_argument("--panels", default=",".join(PANELS), help=f"comma-separated, of {', '.join(PANELS)}")
    args = parser.parse_args()
    names = args.panels.split(",")
    if unknown := [n for n in names if n not in PANELS]:
        parser.error(f"unknown panel(s) {', '.join(unknown)}: choose from {', '.join(PANELS)}")
    panels = [PANELS[n] for n in names]
    figure = Figure(figsize=(4 * len(panels), 3.4))
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(panels), squeeze=False)[0]
    for run in args.runs:
        label, _, path = run.partition("=")
        path = Path(path)
        metrics = read_jsonl(path / "metrics.jsonl" if path.is_dir() else path)
        if not metrics:
            parser.error(f"{path}: no metrics.jsonl records")
        for ax, (key, _, scale) in zip(axes, panels):
            xs, ys = series(metrics, key)
            ax.plot(xs, [y * scale for y in ys], marker=".", label=label)
    for ax, (_, title, _) in zip(axes, panels):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("update")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if args.title:
        figure.suptitle(args.title, fontsize=11)
    figure.tight_layout()
    figure.savefig(args.output, dpi=90)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
