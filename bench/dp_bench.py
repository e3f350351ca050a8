"""Data-parallel scaling of `mlx-grpo train`: the same run on 1 and N processes started with mlx.launch
(one GPU each over NCCL on an NVIDIA machine, else the ring backend), as wall-clock throughput per
update and its ratio to one process. Every figure comes from the runs' own metrics.jsonl
(`time_step_s`: an update's wall time, rollouts to optimizer step); the first --warmup updates
(compilation, allocator warm-up) are left out.

Two scalings of the standard workload (SmolLM2-135M-Instruct in bf16, GSM8K prompts, G=16, 256 new
tokens):
  weak    --batch prompts per process: N processes train N x B prompts per update, each doing the
          work one GPU does alone
  strong  the same --batch prompts per update, split over the N processes

    python bench/dp_bench.py --data path/to/gsm8k/train.jsonl --ranks 2 --out bench-results

Prints a markdown table and the ratios; writes the JSON record to --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

STANDARD = ["model_dtype=bfloat16", "num_generations=16", "max_new_tokens=256", "temperature=1.0",
            "kl_coeff=0.04", "save_steps=0", "eval_every_updates=0", "log_completions_steps=0",
            "logging_steps=1", "warmup_ratio=0"]


def run_training(launcher: list[str], ranks: int, backend: str, batch: int, updates: int, items: list[str],
                 workdir: Path, name: str, timeout: int) -> list[dict]:
    """One `mlx-grpo train` run of `updates` updates on `ranks` processes; -> its metrics records."""
    sets = [f"batch_size={batch}", f"max_train_samples={batch * updates}", f"output_dir={workdir}",
            f"run_name={name}", *STANDARD, *items]
    command = [sys.executable, "-m", "mlx_grpo", "train", *[a for s in sets for a in ("--set", s)]]
    if ranks > 1:
        command = [*launcher, "-n", str(ranks), "--backend", backend, "--", *command]
    print("$", shlex.join(command), flush=True)
    env = {**os.environ, "TQDM_DISABLE": "1"}
    done = subprocess.run(command, text=True, capture_output=True, timeout=timeout, env=env)
    metrics = workdir / name / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    if len(records) < updates:
        raise SystemExit(f"dp_bench: run {name} logged {len(records)} of {updates} updates:\n"
                         f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return records


def summarize(records: list[dict], warmup: int, ranks: int, batch: int, group: int) -> dict:
    timed = records[warmup:]
    step = statistics.mean(r["time_step_s"] for r in timed)
    generated = statistics.mean(r["rollout_tokens_per_s"] * r["time_rollout_s"] for r in timed)
    return {"ranks": ranks, "batch": batch, "rows_per_rank": batch * group // ranks, "updates_timed": len(timed),
            "s_per_update": step, "completions_per_s": batch * group / step, "tokens_per_s": generated / step,
            "rollout_s": statistics.mean(r["time_rollout_s"] for r in timed),
            "logprob_s": statistics.mean(r["time_logprob_s"] for r in timed),
            "train_s": statistics.mean(r["time_train_s"] for r in timed),
            "reward_s": statistics.mean(r["time_reward_s"] for r in timed),
            "peak_memory_gb": max(r["peak_memory_gb"] for r in timed),
            "reward_mean": statistics.mean(r["reward_mean"] for r in records),
            "per_update": [{k: r[k] for k in ("time_step_s", "time_rollout_s", "time_train_s", "completion_length_mean",
                                              "completion_length_max", "truncated_fraction")} for r in records]}


def markdown(rows: list[dict]) -> str:
    lines = ["| scaling | ranks | B (global) | rows/rank | s/update | completions/s | tokens/s | rollout s | "
             "log-prob s | train s | peak GB/rank |", "|---" * 11 + "|"]
    for r in rows:
        lines.append(f"| {r['scaling']} | {r['ranks']} | {r['batch']} | {r['rows_per_rank']} | {r['s_per_update']:.2f} "
                     f"| {r['completions_per_s']:.1f} | {r['tokens_per_s']:.0f} | {r['rollout_s']:.2f} | "
                     f"{r['logprob_s']:.2f} | {r['train_s']:.2f} | {r['peak_memory_gb']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model name or MLX directory")
    ap.add_argument("--data", default="", help="GSM8K-style JSONL/Parquet training file (default: dataset=gsm8k)")
    ap.add_argument("--ranks", type=int, default=2, help="processes of the data-parallel runs")
    ap.add_argument("--batch", type=int, default=16, help="prompts per update of one process (B)")
    ap.add_argument("--updates", type=int, default=6, help="updates per run")
    ap.add_argument("--warmup", type=int, default=1, help="first updates left out of the timing")
    ap.add_argument("--scalings", default="weak,strong", help="weak, strong or both")
    ap.add_argument("--backend", default="", help="mlx.launch backend (default: nccl with CUDA, else ring)")
    ap.add_argument("--launcher", default="mlx.launch", help="the launcher command (e.g. 'python -m ...')")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more train settings")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    ap.add_argument("--out", default="bench-results", help="directory for the JSON record")
    args = ap.parse_args(argv)
    if args.updates <= args.warmup:
        ap.error("--updates must exceed --warmup")
    backend = args.backend or ("nccl" if mx.cuda.is_available() else "ring")
    group = 16
    items = [f"model_name={args.model}", f"dataset_path={args.data}" if args.data else "dataset=gsm8k", *args.set]
    for item in items:
        if item.startswith("num_generations="):
            group = int(item.split("=", 1)[1])
    plan = [("baseline", 1, args.batch)]
    scalings = [s.strip() for s in args.scalings.split(",") if s.strip()]
    if "weak" in scalings:
        plan.append(("weak", args.ranks, args.batch * args.ranks))
    if "strong" in scalings:
        plan.append(("strong", args.ranks, args.batch))
    rows = []
    with tempfile.TemporaryDirectory(prefix="dp-bench-") as tmp:
        for label, ranks, batch in plan:
            records = run_training(shlex.split(args.launcher), ranks, backend, batch, args.updates, items,
                                   Path(tmp), f"{label}-{ranks}", args.timeout)
            rows.append({"scaling": label, **summarize(records, args.warmup, ranks, batch, group)})
    base = rows[0]
    for r in rows:
        r["throughput_ratio"] = r["completions_per_s"] / base["completions_per_s"]
        r["efficiency"] = r["throughput_ratio"] / r["ranks"]
    print(markdown(rows))
    for r in rows[1:]:
        print(f"{r['scaling']}: {r['ranks']} ranks give {r['throughput_ratio']:.2f}x the completions/s of 1 "
              f"(scaling efficiency {r['efficiency']:.0%})")
    record = {"date": dt.datetime.now().isoformat(timespec="seconds"), "device": mx.device_info().get(
        "device_name", str(mx.default_device())), "backend": backend, "mlx": mx.__version__,
              "argv": sys.argv[1:] if argv is None else argv, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"dp_bench-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
