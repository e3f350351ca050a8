"""Overlay one recipe's GRPO runs over seeds: a few metrics per update, one line per run, into one PNG.

`mlx-grpo plot` draws one run; docs/learning.md's per-seed figures need the same metric from several runs
(one per seed) side by side. Reads each run directory's metrics.jsonl through mlx_grpo.plot.

    python bench/seed_curves.py -o docs/learning-prod-tools-seeds.png s42=RUN_DIR s7=RUN_DIR s1234=RUN_DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from mlx_grpo.plot import read_jsonl, series

# (metrics.jsonl key, panel title, scale): reasoned_correctness pays 2.0 for a right answer, so half its
# mean is the share of right completions among those drawn.
PANELS = [
    ("reward/reasoned_correctness", "right answers among drawn completions", 0.5),
    ("reward/reasoned_format", "reasoned_format reward", 1.0),
    ("draws", "batches drawn per update", 1.0),
    ("kl", "KL to the reference", 1.0),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="LABEL=RUN_DIR, one per seed")
    parser.add_argument("-o", "--output", type=Path, required=True)
    parser.add_argument("--title", default="")
    args = parser.parse_args()
    figure = Figure(figsize=(4 * len(PANELS), 3.4))
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(PANELS))
    for label, run_dir in (run.split("=", 1) for run in args.runs):
        metrics = read_jsonl(Path(run_dir) / "metrics.jsonl")
        if not metrics:
            raise SystemExit(f"{run_dir}: no metrics.jsonl records")
        for ax, (key, _, scale) in zip(axes, PANELS):
            xs, ys = series(metrics, key)
            ax.plot(xs, [y * scale for y in ys], marker=".", label=label)
    for ax, (_, title, _) in zip(axes, PANELS):
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
