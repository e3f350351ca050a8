"""What a step that feeds k+1 tokens per row costs against the one-token decode step (issue 47, deliver 3:
drafting pays only if verifying a draft of k tokens costs little more than sampling one): mlx-lm's forward of a
model of SmolLM2-135M's shape (the embedded default, random weights) on KV caches already holding `--past`
tokens per row, for T = 1 and the other token counts, at each row count. Every T runs on the same caches, whose
buffers are a multiple of 256 slots as mlx-lm's own are (on CUDA in bfloat16, MLX then runs cuDNN's attention for
one-token queries too, once past + 1 >= 256: the same kernel for every T), so the ratio and the milliseconds added, not the seconds, are the
measurement: the engine's own one-token step is faster (its fused kernel), and a verify step built for it would
be too; mlx-lm's host work (~10 ms a step on an H200 whatever T) pulls the ratio towards 1. Session 40's records
came from the first version, whose buffers were past + max(T) slots (T = 1 on MLX's own attention there).

With draft_acceptance.py's 1.62 tokens a step (k = 4 from a group's siblings, session 38's completions), drafting
shortens a pass only if the T = 5 step costs well under 1.62x the T = 1 step.

usage: python bench/verify_step.py [--rows 256,1024] [--past 384] [--tokens 1,3,5,9] [--repeats 5] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_util import device_name, positive, smollm2_shaped  # noqa: E402


def filled_caches(model: llama.Model, rows: int, past: int, room: int, dtype) -> list[KVCache]:
    """One KVCache per layer holding `past` random tokens per row, with room for at least `room` more (no growth
    when timed), its buffer a multiple of KVCache.step slots as mlx-lm's caches grow."""
    caches, slots = [], -(-(past + room) // KVCache.step) * KVCache.step
    for _ in model.layers:
        cache = KVCache()
        shape = (rows, model.args.num_key_value_heads, slots, model.args.hidden_size // model.args.num_attention_heads)
        cache.keys = (mx.random.normal(shape) * 0.1).astype(dtype)
        cache.values = (mx.random.normal(shape) * 0.1).astype(dtype)
        cache.offset = past
        caches.append(cache)
    mx.eval([c.keys for c in caches] + [c.values for c in caches])
    return caches


def step_seconds(model, caches, rows: int, T: int, past: int, repeats: int, warmup: int = 2) -> float:
    """Median seconds of one forward of T tokens per row (logits evaluated), the caches rewound after each."""
    tokens = mx.random.randint(0, model.args.vocab_size, (rows, T))
    slots = caches[0].keys.shape[2]
    if past + T > slots:  # mlx-lm would grow the cache: a copy timed with the step
        raise ValueError(f"{T} tokens after {past} do not fit the caches' {slots} slots")
    times = []
    for i in range(warmup + repeats):
        for c in caches:
            c.offset = past
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(model(tokens, cache=caches))
        mx.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    assert all(c.keys.shape[2] == slots for c in caches), "a cache grew while timed"
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="256,1024")
    ap.add_argument("--past", type=positive, default=384, help="tokens already in each row's cache (255 or more: "
                    "the one-token step on cuDNN's attention as the others, on CUDA)")
    ap.add_argument("--tokens", default="1,3,5,9", help="tokens fed per row in one step (1: the decode step)")
    ap.add_argument("--repeats", type=positive, default=5)
    ap.add_argument("--layers", type=positive, default=30, help="fewer for a quick run (the default model has 30)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    rows_list, tokens = [int(r) for r in args.rows.split(",")], [int(t) for t in args.tokens.split(",")]
    if 1 not in tokens or min(tokens + rows_list) < 1:
        ap.error("--tokens must include 1 (the decode step the others are measured against); counts at least 1")
    mx.random.seed(args.seed)
    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    model = smollm2_shaped(args.layers, dtype)
    command = shlex.join(["python", "bench/verify_step.py"] + (sys.argv[1:] if argv is None else list(argv)))
    out = {"device": device_name(), "command": command, "mlx": mx.__version__, "dtype": str(dtype),
           "layers": args.layers, "past": args.past, "runs": []}
    for rows in rows_list:
        caches = filled_caches(model, rows, args.past, max(tokens), dtype)
        seconds = {T: step_seconds(model, caches, rows, T, args.past, args.repeats) for T in sorted(tokens)}
        for T in sorted(tokens):
            run = {"rows": rows, "tokens": T, "slots": caches[0].keys.shape[2], "seconds": seconds[T],
                   "vs_one": seconds[T] / seconds[1], "added_ms": (seconds[T] - seconds[1]) * 1e3}
            out["runs"].append(run)
            print(f"{rows} rows, {T} token(s) a row: {seconds[T] * 1e3:.2f} ms, {run['vs_one']:.2f}x the one-token "
                  f"step (+{run['added_ms']:.2f} ms)", flush=True)
        del caches
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
