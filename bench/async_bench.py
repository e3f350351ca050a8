"""async_rollouts = 0 against 1 (issue 25): the run's own throughput, updates per minute over N updates of
`mlx-grpo train`, each mode in its own process, as a user runs it.

Standard workload (the defaults): the embedded SmolLM2-135M-Instruct in bf16, GSM8K prompts, B=16 x G=16,
max_new_tokens=256, temperature 1.0, rollout_correction = token_truncate in both modes (async needs it; in
the synchronous run its weights are ~1, so both train the same objective), 20 updates:

    python bench/async_bench.py --data .gpudata/train.jsonl --out bench-results/async

Updates per minute leave out update 1 (kernel builds, compilation): 60 x (N - 1) / the summed wall time
of updates 2..N (metrics.jsonl's time_step_s: from one update's end to the next one's, all of it). The
split is the median over the same updates: rollout (decode; under async it runs in the background thread,
overlapping the rest), reward, log-probs and train, and what of the step none of these covers (under async:
the wait for the background rollout, the log-prob passes and the update around it). --set passes config
overrides to every run (e.g. --set compile_update=true --set use_compile=true). Mode 1p is async_rollouts = 1
with rollout_worker = process (the rollout in a process of its own): `--modes 0,1,1p`. Its peak_memory_gb is
the training process's only; the rollout process's is not in metrics.jsonl.

A dry run on a CPU with a tiny model (tests' write_tiny_model) checks the script end to end:

    python bench/async_bench.py --model /tmp/tiny --dataset arith --batch 2 --group 4 --max-new-tokens 8 \
        --updates 4 --out /tmp/async-bench
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_util import device_name, versions

PARTS = ("time_rollout_s", "time_reward_s", "time_logprob_s", "time_train_s")


def run_mode(args: argparse.Namespace, mode: str, out: Path) -> dict:
    """One `mlx-grpo train` of args.updates updates with async_rollouts = mode (1p: 1 in a rollout process)
    -> its figures."""
    name = f"async{mode}"
    where = ["rollout_worker=process"] if mode == "1p" else []
    items = [f"model_name={args.model}", f"model_dtype={args.dtype}", f"batch_size={args.batch}",
             f"num_generations={args.group}", f"max_new_tokens={args.max_new_tokens}",
             f"temperature={args.temperature}", f"max_train_samples={args.batch * args.updates}", "num_epochs=1",
             "save_steps=0", "log_completions_steps=0", "eval_every_updates=0", "eval_steps=0",
             "rollout_correction=token_truncate", f"async_rollouts={mode[0]}", *where, f"output_dir={out}",
             f"run_name={name}",
             *([f"dataset_path={args.data}"] if args.data else [f"dataset={args.dataset}"]), *args.set]
    command = [sys.executable, "-m", "mlx_grpo", "train", *(a for item in items for a in ("--set", item))]
    print(f"== async_rollouts = {mode}: {' '.join(command)}", flush=True)
    t0 = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    wall = time.perf_counter() - t0
    (out / f"{name}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"async_bench: the async_rollouts = {mode} run failed (exit {done.returncode}); "
                         f"last lines:\n{(done.stdout + done.stderr)[-2000:]}")
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    timed = rows[1:] or rows  # update 1 builds kernels and compiles
    step = sum(r["time_step_s"] for r in timed)
    figures = {"updates": len(rows), "updates_per_minute": 60 * len(timed) / step if step > 0 else 0.0,
               "process_wall_s": wall, "step_s": statistics.median(r["time_step_s"] for r in timed),
               **{p: statistics.median(r[p] for r in timed) for p in PARTS},
               "peak_memory_gb": max(r["peak_memory_gb"] for r in rows),
               "reward_mean_last": rows[-1]["reward_mean"], "staleness": [r.get("rollout_staleness") for r in rows],
               "is_weight_mean": statistics.mean(r["is_weight_mean"] or 1.0 for r in timed),
               "sampler_kl": statistics.mean(r["sampler_kl"] or 0.0 for r in timed)}
    serial = figures["time_logprob_s"] + figures["time_train_s"] + (
        figures["time_rollout_s"] + figures["time_reward_s"] if mode == "0" else 0.0)
    figures["other_s"] = figures["step_s"] - serial
    return figures


def markdown(result: dict) -> str:
    lines = ["| async_rollouts | updates/min | step s (median) | rollout | reward | log-probs | train | other | "
             "peak GB | sampler_kl | IS weight |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
             "---: | ---: |"]
    for mode, r in result["modes"].items():
        if r:
            lines.append(f"| {mode} | {r['updates_per_minute']:.2f} | {r['step_s']:.2f} | {r['time_rollout_s']:.2f}"
                         f"{' (overlapped)' if mode != '0' else ''} | {r['time_reward_s']:.2f} | "
                         f"{r['time_logprob_s']:.2f} | {r['time_train_s']:.2f} | {r['other_s']:.2f} | "
                         f"{r['peak_memory_gb']:.1f} | {r['sampler_kl']:.2e} | {r['is_weight_mean']:.4f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model name or MLX directory")
    ap.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--data", default="", help="GSM8K-style JSONL/Parquet file (default: --dataset)")
    ap.add_argument("--dataset", default="gsm8k", choices=["gsm8k", "arith"])
    ap.add_argument("--batch", type=int, default=16, help="B prompts per update")
    ap.add_argument("--group", type=int, default=16, help="G completions per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--updates", type=int, default=20, help="updates per run (the first is left out of the figures)")
    ap.add_argument("--modes", default="0,1", help="async_rollouts values to run, in this order (1p: 1 with "
                    "rollout_worker = process)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides for every run")
    ap.add_argument("--out", default="bench-results/async", help="directory for the runs, logs and the JSON record")
    args = ap.parse_args(argv)
    wanted = [m for m in args.modes.split(",") if m]
    if any(m not in ("0", "1", "1p") for m in wanted):  # before any run: a typo must not cost the runs before it
        ap.error(f"--modes takes 0, 1 and 1p, got {args.modes!r}")
    out = Path(args.out) / f"{dt.datetime.now():%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    result = {"date": dt.date.today().isoformat(), "device": device_name(), "versions": versions(),
              "command": " ".join([Path(sys.argv[0]).as_posix()] + (argv if argv is not None else sys.argv[1:])),
              "workload": {"model": args.model, "dtype": args.dtype, "B": args.batch, "G": args.group,
                           "max_new_tokens": args.max_new_tokens, "updates": args.updates,
                           "data": args.data or args.dataset, "set": args.set}, "modes": {}}
    for mode in wanted:
        r = result["modes"][mode] = run_mode(args, mode, out)
        print(f"   {r['updates_per_minute']:.2f} updates/min; median step {r['step_s']:.2f} s; peak "
              f"{r['peak_memory_gb']:.1f} GB; process {r['process_wall_s']:.0f} s", flush=True)
        (out / "async_bench.json").write_text(json.dumps(result, indent=2))  # what is done survives a timeout
    print()
    print(markdown(result))
    modes = result["modes"]
    for mode in ("1", "1p"):
        if "0" in modes and mode in modes and modes["0"]["updates_per_minute"] > 0:
            ratio = modes[mode]["updates_per_minute"] / modes["0"]["updates_per_minute"]
            print(f"\nasync_rollouts = {mode} vs 0: {ratio:.2f}x updates per minute (updates 2-{args.updates})")
    print(f"JSON: {out / 'async_bench.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
