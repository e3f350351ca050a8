"""The "Tools" tables of docs/learning.md from what bench/tools_run.sh wrote: greedy accuracy of the base
and trained models with and without the calculator (95% Wilson intervals), the share of greedy answers
that called it, and each run's updates, minutes and tool use during training.

usage: python bench/tools_report.py OUT_DIR    (OUT_DIR as given to tools_run.sh)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learning_report import accuracy_row, eval_rows, wilson  # noqa: E402

RUNS = {"arith": "arith", "arith_tools": "arith-tools"}  # preset -> run_name


def calls_cell(rows: list[dict]) -> str:
    if "tool_calls" not in rows[0]:
        return "-"
    k, n = sum(r["tool_calls"] > 0 for r in rows), len(rows)
    lo, hi = wilson(k, n)
    return f"{k}/{n} = {100 * k / n:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]"


def training_row(preset: str, out: Path) -> str:
    run = out / "runs" / RUNS[preset]
    # a results copy has no runs/; metrics.jsonl is one JSON object a line, as an evaluation's file
    metrics = eval_rows((run if run.is_dir() else out / RUNS[preset]) / "metrics.jsonl")
    minutes = sum(m["time_step_s"] for m in metrics) / 60

    def mean(key: str, part: list[dict]) -> str:
        values = [m[key] for m in part if key in m]
        return f"{sum(values) / len(values):.2f}" if values else "-"

    first, last = metrics[:5], metrics[-5:]
    return (f"| {preset} | {len(metrics)} | {minutes:.1f} | {mean('reward_mean', first)} -> {mean('reward_mean', last)} "
            f"| {mean('tool_call_rate', first)} -> {mean('tool_call_rate', last)} "
            f"| {mean('completion_length_mean', first)} -> {mean('completion_length_mean', last)} |")


def summary_row(name: str, log: Path) -> str:
    """The row from an evaluation's printed summary, where its per-example JSONL is missing."""
    line = next(x for x in log.read_text().splitlines() if x.startswith("accuracy:"))
    n = int(re.search(r"\(\d+/(\d+)\)", line).group(1))
    cells = []
    for key in ("accuracy", "lenient", "formatted", "tool calls"):
        found = re.search(rf"{key}: ([\d.]+)", line)
        if found is None:
            cells.append("-")
            continue
        k = round(float(found.group(1)) * n)
        lo, hi = wilson(k, n)
        cells.append(f"{k}/{n} = {100 * k / n:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]")
    return f"| {name} | " + " | ".join(cells) + " |"


def main(out: Path) -> None:
    print("| model | exact match (`<answer>`) [95% CI] | lenient (last number) | formatted | called the calculator |")
    print("|---|---|---|---|---|")
    for preset in RUNS:
        for stage in ("base", "trained"):
            path = out / f"{preset}-{stage}.jsonl"
            if path.is_file():
                rows = eval_rows(path)
                # accuracy_row's last cell (the share that called a tool) with its interval instead
                print(accuracy_row(f"{preset} {stage}", rows).rsplit(" | ", 1)[0] + f" | {calls_cell(rows)} |")
            else:
                print(summary_row(f"{preset} {stage}", out / f"{preset}-{stage}.log"))
    print()
    print("| run | updates | minutes of updates | reward, first 5 -> last 5 | tool-call rate | model tokens |")
    print("|---|---|---|---|---|---|")
    for preset in RUNS:
        print(training_row(preset, out))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
