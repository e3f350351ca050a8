"""The tables of docs/learning.md from what bench/learning_run.sh wrote: greedy accuracy of the base and the
trained model with 95% Wilson intervals, and the collapse figures at the end of training (mean completion
length, share of completions with empty reasoning, entropy).

usage: python bench/learning_report.py OUT_DIR    (OUT_DIR as given to learning_run.sh, or a bench/records folder,
whose per-question evaluations are kept as .csv: one row per question, no completions)
"""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from mlx_grpo.rewards.builtin import reasoning_text, substantive  # noqa: E402


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k/n."""
    if n == 0:
        return 0.0, 0.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def eval_rows(path: Path) -> list[dict]:
    """An evaluation's per-question rows: `mlx-grpo eval`'s .jsonl, or a record's .csv (0/1 flags, call counts)."""
    if path.suffix == ".csv":
        with path.open(newline="") as f:
            return [{k: (int(v) if k in ("correct", "lenient", "formatted", "tool_calls") else v)
                     for k, v in row.items()} for row in csv.DictReader(f)]
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def accuracy_row(name: str, path: Path) -> str:
    rows = eval_rows(path)
    n = len(rows)
    cells = []
    for key in ("correct", "lenient", "formatted"):
        k = sum(bool(r[key]) for r in rows)
        lo, hi = wilson(k, n)
        cells.append(f"{k}/{n} = {100 * k / n:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]")
    # runs with tools record each answer's calls; "-" where the run had none to call
    calls = sum(bool(r.get("tool_calls")) for r in rows)
    cells.append(f"{100 * calls / n:.1f}%" if any("tool_calls" in r for r in rows) else "-")
    return f"| {name} | " + " | ".join(cells) + " |"


def empty_reasoning(text: str, prompt) -> bool:
    """No reasoning of substance by the reward's own test (substantive)."""
    return not substantive(reasoning_text(text), prompt)


def short_reasoning(text: str) -> bool:
    """An independent check of the same thing: fewer than 5 words before the first </reasoning> or <answer>."""
    reasoning = reasoning_text(text) or ""
    return len(reasoning.split()) < 5


def collapse_row(name: str, run: Path) -> str:
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    completions = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    last_step = max(c["update_step"] for c in completions)
    last = [c for c in completions if c["update_step"] == last_step]
    tail = metrics[-5:]
    length = sum(m["completion_length_mean"] for m in tail) / len(tail)
    entropy = sum(m["entropy"] for m in tail) / len(tail)
    first_entropy = metrics[0]["entropy"]
    empty = sum(empty_reasoning(c["completion"], c["prompt"]) for c in last) / len(last)
    short = sum(short_reasoning(c["completion"]) for c in last) / len(last)
    times = sorted(m["time_step_s"] for m in metrics)
    return (f"| {name} | {len(metrics)} | {metrics[0]['completion_length_mean']:.0f} -> {length:.0f} | "
            f"{100 * empty:.1f}% ({100 * short:.1f}% under 5 words; update {last_step}, {len(last)} completions) | "
            f"{first_entropy:.2f} -> {entropy:.2f} | "
            f"{sum(m['time_step_s'] for m in metrics) / 60:.1f} min, median {times[len(times) // 2]:.1f} s |")


def main(out: Path) -> None:
    """One accuracy row per evaluation bench/learning_run.sh wrote (<recipe>-s<seed>-<stage>.jsonl, or .csv)."""
    print("| recipe, seed | model | exact match (<answer>) [95% CI] | lenient (last number) | formatted | "
          "called a tool |")
    print("|---|---|---|---|---|---|")
    stages = ("base", "sft", "trained")
    found = [*out.glob("*-s*-*.jsonl"), *out.glob("*-s*-*.csv")]
    for path in sorted(found, key=lambda p: (p.name.rsplit("-", 1)[0], stages.index(
            p.stem.rsplit("-", 1)[1]) if p.stem.rsplit("-", 1)[1] in stages else 9)):
        tag, stage = path.stem.rsplit("-", 1)
        if stage in stages:
            print(accuracy_row(f"{tag} | {stage}", path))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
