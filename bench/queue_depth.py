"""How far ahead of the device the host can queue decode steps, and how much host work at a sync those queued steps
hide: the question behind the decode loop's `lookahead` (issue 47). A sync of a tool-calling rollout spends ~75 ms
of host work (stop checks, turns handed over, admissions) on an H200; the loop's lookahead lets it read rows a few
steps old so that this work runs while those steps are on the device, but only as far as the device still holds
queued steps when the host gets there. MLX's backends commit a graph every so many operations or megabytes
(MLX_MAX_OPS_PER_BUFFER, MLX_MAX_MB_PER_BUFFER) and `async_eval` waits while too many commits are pending, so a step
of a few hundred operations may let the host run only a step or two ahead, whatever the lookahead.

For each row count, with a decode step of decode_profile's builders (by default "engine_inplace": the engine's
compiled step writing each token's keys/values into the cache in place where the fused CUDA kernel serves, as the
engine's loop does; elsewhere the same as "engine"), after --warmup steps:
  step ms        wall time per step with the largest K dispatched back to back, then waited for: the device's
                 time per step where the device is the bound, the host's where it is (dispatch ms / K near it)
  dispatch ms    host time to dispatch K steps with async_eval (it returns before the device ends)
  queued         steps still queued when the host is done dispatching: K - dispatch / step
  then, for each host work X (a busy loop on the host after the K steps are dispatched, as a sync's work):
  total ms       from the first dispatch to the device's end
  hidden         the share of X the queued steps hid: (total without X + X - total) / X, 1 = all of it

Run it under the MLX settings to compare (each process reads them once):
    python bench/queue_depth.py --rows 256,1024 --ahead 1,2,4,8 --host-ms 25,75
    MLX_USE_CUDA_GRAPHS=0 python bench/queue_depth.py --rows 1024
    MLX_MAX_OPS_PER_BUFFER=1000 python bench/queue_depth.py --rows 1024
    python bench/queue_depth.py --shape tiny-qwen2 --rows 8 --dtype float32 --ahead 1,2 --host-ms 5 \\
        --max-new-tokens 64 --warmup 2 --repeats 1 --out /tmp/queue.json            # a CPU smoke run
Prints a markdown table; writes the JSON record to --out (a .json file or a directory).
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
from pathlib import Path

import decode_profile as dp  # first: it loads the optimized BLAS before mlx.core, as the CLI does

import mlx.core as mx  # noqa: E402

import shapes  # noqa: E402
from bench_util import device_name, mlx_settings, versions, write_record  # noqa: E402


def busy(ms: float) -> None:
    """The host busy for ms milliseconds (Python running, as a sync's work: not a sleep)."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def queue(decoder, ahead: int, host_ms: float) -> tuple[float, float]:
    """After a full sync: dispatch `ahead` steps with async_eval, the host busy for host_ms, then wait for the device.
    -> (seconds to dispatch, seconds from the first dispatch to the end)."""
    mx.eval(decoder.step())
    t0 = time.perf_counter()
    for _ in range(ahead):
        outputs = decoder.step()
        mx.async_eval(outputs)
    t1 = time.perf_counter()
    busy(host_ms)
    mx.eval(outputs)
    return t1 - t0, time.perf_counter() - t0


def measure(decoder, warmup: int, aheads: list[int], hosts: list[float], repeats: int) -> dict:
    for _ in range(warmup):  # kernel builds, the step's trace
        mx.eval(decoder.step())
    longest = max(aheads)
    step = statistics.median(queue(decoder, longest, 0)[1] / longest for _ in range(repeats))
    found = []
    for k in aheads:
        plain = [queue(decoder, k, 0) for _ in range(repeats)]  # K steps and no host work: the baseline of each X
        dispatch, alone = statistics.median(p[0] for p in plain), statistics.median(p[1] for p in plain)
        row = {"ahead_steps": k, "dispatch_ms": 1e3 * dispatch, "alone_ms": 1e3 * alone,
               "queued_at_return": k - dispatch / step, "hosts": []}
        for x in hosts:
            total = statistics.median(queue(decoder, k, x)[1] for _ in range(repeats))
            row["hosts"].append({"host_ms": x, "total_ms": 1e3 * total, "hidden": (alone + x / 1e3 - total) / (x / 1e3)})
        found.append(row)
    return {"step_ms": 1e3 * step, "ahead": found}


def markdown(result: dict) -> str:
    hosts = result["workload"]["host_ms"]
    lines = ["| step | rows | step ms | K | dispatch ms | queued at return | alone ms | "
             + " | ".join(f"X = {x:g} ms: total, hidden" for x in hosts) + " |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in hosts) + " |"]
    for r in result["results"]:
        for q in r["ahead"]:
            cells = [f"{h['total_ms']:.1f} ms, {h['hidden']:.0%}" for h in q["hosts"]]
            lines.append(f"| {r['builder']} | {r['rows']} | {r['step_ms']:.2f} | {q['ahead_steps']} | "
                         f"{q['dispatch_ms']:.2f} | {q['queued_at_return']:.1f} | {q['alone_ms']:.1f} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines)


def ints(text: str, name: str, ap) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ap.error(f"{name}: comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        ap.error(f"{name}: positive integers, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="queue_depth", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model name or MLX directory")
    ap.add_argument("--shape", default="", choices=["", *shapes.SHAPES],
                    help="a random-weight model of this architecture instead of --model (bench/shapes.py)")
    ap.add_argument("--dtype", default="bfloat16", choices=dp.DTYPES)
    ap.add_argument("--rows", default="1024", help="decode rows N = B x G, comma-separated")
    ap.add_argument("--group", type=int, default=16, help="G completions per prompt (B = N / G prompts)")
    ap.add_argument("--prompt-len", type=int, default=160, help="longest prompt; lengths spread over [1/2, 1]x")
    ap.add_argument("--max-new-tokens", type=int, default=512, help="the cache capacity (steps run in all)")
    ap.add_argument("--ahead", default="1,2,4,8", help="steps K dispatched before the host work, comma-separated")
    ap.add_argument("--host-ms", default="25,75", help="host work X after them (milliseconds), comma-separated")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="medians over this many measurements")
    ap.add_argument("--builder", default="engine_inplace", choices=sorted(dp.STEP_BUILDERS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-results", help="JSON file (*.json) or directory for the record")
    args = ap.parse_args(argv)
    rows, aheads = ints(args.rows, "--rows", ap), ints(args.ahead, "--ahead", ap)
    hosts = [float(x) for x in ints(args.host_ms, "--host-ms", ap)]
    if args.repeats < 1 or args.warmup < 0 or args.group < 1:
        ap.error("--repeats and --group must be positive, --warmup not negative")
    # every measurement runs one more step than it times; each step takes a cache slot and one of the
    # max_new_tokens step keys, of which the prefill's token took the first
    needed = 1 + args.warmup + args.repeats * (1 + max(aheads) + sum(k + 1 for k in aheads) * (1 + len(hosts)))
    if args.max_new_tokens < needed:
        ap.error(f"--max-new-tokens {args.max_new_tokens}: the measurements take {needed - 1} steps after the "
                 f"prefill's token ({needed} needed)")
    bad = [n for n in rows if n % min(args.group, n)]
    if bad:
        ap.error(f"--rows {bad[0]} is not a multiple of --group {args.group}")
    try:
        return run(args, rows, aheads, hosts, argv)
    except dp.UserError as exc:  # e.g. a model the sampling copy does not serve
        print(f"queue_depth: error: {exc}", file=sys.stderr)
        return 2


def run(args, rows: list[int], aheads: list[int], hosts: list[float], argv) -> int:
    model, name = dp.load(args)
    result = {"date": dt.date.today().isoformat(), "device": device_name(), "versions": versions(),
              "mlx_settings": mlx_settings(), "command": " ".join([Path(sys.argv[0]).as_posix()] + (
                  argv if argv is not None else sys.argv[1:])),
              "workload": {"model": name, "dtype": args.dtype, "prompt_len": args.prompt_len, "group": args.group,
                           "ahead": aheads, "host_ms": hosts, "warmup": args.warmup, "repeats": args.repeats},
              "results": []}
    for n in rows:
        g = min(args.group, n)
        prompts = dp.make_prompts(n // g, args.prompt_len, min(model.args.vocab_size, 49152), args.seed)
        with dp.STEP_BUILDERS[args.builder](model, prompts, g, args.max_new_tokens, args.seed) as decoder:
            r = {"builder": args.builder, "rows": n, **measure(decoder, args.warmup, aheads, hosts, args.repeats)}
        result["results"].append(r)
        mx.clear_cache()
    out = write_record(args.out, "queue_depth", result)
    print(markdown(result))
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
