"""The tables of docs/learning.md from what bench/learning_run.sh wrote: greedy accuracy of the base and the
trained model with 95% Wilson intervals; each run's trained model against the model it started from (its warm
start, else the base), paired on the questions with an exact McNemar test, and pooled over the runs given; and
the collapse figures at the end of training (mean completion length, share of completions with empty
reasoning, entropy).

usage: python bench/learning_report.py OUT_DIR [OUT_DIR ...]    (OUT_DIR as given to learning_run.sh, or a
bench/records folder, whose per-question evaluations are kept as .csv: one row per question, no completions)
"""

from __future__ import annotations

import csv
import hashlib
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


def question(row: dict) -> str:
    """A question's key: a record's `q`, else the first 12 hex digits of the SHA-1 of its prompt (what the records'
    .csv files keep in `q`; a prompt of chat messages as its JSON)."""
    if "q" in row:
        return row["q"]
    prompt = row["prompt"] if isinstance(row["prompt"], str) else json.dumps(row["prompt"])
    return hashlib.sha1(prompt.encode()).hexdigest()[:12]


def mcnemar(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value of b questions only the second model solves and c only the first: under
    no difference each of the b + c is either way with probability 1/2; twice the smaller tail, at most 1."""
    n = b + c
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2 ** n)


def paired(before: list[dict], after: list[dict], name: str = "") -> tuple[int, int, int, int, int]:
    """Two evaluations of the same questions in the same order -> (questions, solved before, solved after, solved
    only after, solved only before)."""
    if [question(r) for r in before] != [question(r) for r in after]:
        raise ValueError(f"{name or 'two evaluations'}: not the same questions in the same order")
    pairs = [(bool(x["correct"]), bool(y["correct"])) for x, y in zip(before, after)]
    return (len(pairs), sum(x for x, _ in pairs), sum(y for _, y in pairs), sum(y and not x for x, y in pairs),
            sum(x and not y for x, y in pairs))


def p_text(p: float) -> str:
    """0.39, 0.004, 0.00097, 4e-7: two significant digits down to 0.001 (as rounded), one below; under 1e-300
    (a float's floor, where the tail underflows to 0) as such."""
    if p < 1e-300:
        return "< 1e-300"
    if p >= 0.00095:
        return f"{float(f'{p:.2g}'):g}"
    mantissa, exponent = f"{p:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def rate(k: int, n: int) -> str:
    """k/n = x% [95% Wilson interval]."""
    lo, hi = wilson(k, n)
    return f"{k}/{n} = {100 * k / n:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]"


def paired_row(name: str, counts: tuple[int, int, int, int, int]) -> str:
    n, before, after, only_after, only_before = counts
    return (f"| {name} | {rate(before, n)} -> {rate(after, n)} | {100 * (after - before) / n:+.1f} | "
            f"{only_after} / {only_before}, p = {p_text(mcnemar(only_after, only_before))} |")


def accuracy_row(name: str, rows: list[dict]) -> str:
    """One evaluation's row of the accuracy table (rows: eval_rows')."""
    n = len(rows)
    cells = []
    for key in ("correct", "lenient", "formatted"):
        cells.append(rate(sum(bool(r[key]) for r in rows), n))
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


def main(outs: list[Path]) -> None:
    """One accuracy row per evaluation bench/learning_run.sh wrote (<recipe>-s<seed>-<stage>.jsonl, or .csv) in
    each folder; then each trained model paired with the model it started from (its warm start, else the base),
    and per recipe over several seeds a pooled row: the discordant questions summed, an exact test of these
    trained models on these questions (each counted once per seed), not of the seed-to-seed spread of training."""
    given = {}  # each folder once (however spelled), as first given
    for out in outs:
        given.setdefault(out.resolve(), out)
    outs = list(given.values())
    stages = ("base", "sft", "trained")
    runs: dict[tuple[str, str], dict[str, Path]] = {}  # (recipe-seed, its folder) -> stage -> one evaluation
    for out in outs:
        found = [*out.glob("*-s*-*.jsonl"), *out.glob("*-s*-*.csv")]  # a stage's .jsonl wins over its .csv
        for path in found:
            tag, stage = path.stem.rsplit("-", 1)
            if stage in stages:
                runs.setdefault((tag, str(out)), {}).setdefault(stage, path)
    print("| recipe, seed | model | exact match (<answer>) [95% CI] | lenient (last number) | formatted | "
          "called a tool |")
    print("|---|---|---|---|---|---|")
    name = {run: run[0] if len(outs) == 1 else f"{run[0]} ({run[1]})" for run in runs}
    read = {path: eval_rows(path) for found in runs.values() for path in found.values()}  # each file read once
    for run in sorted(runs):
        for stage in (s for s in stages if s in runs[run]):
            print(accuracy_row(f"{name[run]} | {stage}", read[runs[run][stage]]))
    pools: dict[tuple[str, str], list] = {}  # (recipe, the stage trained from) -> [(run, questions, counts)]
    for run in sorted(runs):
        found = runs[run]
        start = next((s for s in ("sft", "base") if s in found), None)
        if "trained" in found and start:
            before, after = read[found[start]], read[found["trained"]]
            counts = paired(before, after, f"{name[run]}, {start} -> trained")
            pools.setdefault((run[0].rsplit("-s", 1)[0], start), []).append((run, [question(r) for r in after], counts))
    if pools:
        print("\n| recipe, seed | from -> trained, exact match | gain (points) | paired: only trained / only "
              "before |")
        print("|---|---|---|---|")
        for (recipe, start), members in pools.items():
            for run, _, counts in members:
                print(paired_row(f"{name[run]}, {start} -> trained", counts))
            if len(members) > 1 and all(q == members[0][1] for _, q, _ in members):  # same questions: poolable
                print(paired_row(f"{recipe} pooled over {len(members)}, {start} -> trained",
                                 tuple(sum(c[i] for _, _, c in members) for i in range(5))))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python bench/learning_report.py OUT_DIR [OUT_DIR ...]")
    main([Path(a) for a in sys.argv[1:]])
