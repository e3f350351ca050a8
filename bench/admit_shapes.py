"""What an admission's prefill costs the first time MLX sees its shape against the next: decoder.prefill_after (a
turn's chunk on top of its kept cache, as the decode loop's refills run it) over the shapes a trainer's refills
take (n rows admitted, chunk C, timeline W), each shape timed twice in a row, for each way of attending:

  sdpa    mx.fast.scaled_dot_product_attention with the boolean mask (on CUDA in bfloat16: cuDNN, whose graph MLX
          builds and caches per shape, 256 of them per thread)
  matmul  the same attention as matmuls and a float32 softmax (decoder.masked_attention's alternative below)
  sdpa8   sdpa with the admitted rows padded to a multiple of 8 (fewer distinct shapes)

A tools_bench pass repeats its warm-up's shapes; a trainer's passes meet new ones every update (and its training
step's attention fills the same cache): session 37 measured a trainer's in-place admissions at 3.2x the bench's.

usage: python bench/admit_shapes.py [--shapes 60] [--max-rows 240] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from mlx_grpo.models import decoder  # noqa: E402

from bench_util import device_name, smollm2_shaped  # noqa: E402


def matmul_attention(q, k, v, scale, mask):
    """Attention as matmuls: q [n, H, C, Dh], k, v [n, Hkv, W, Dh], mask [n, 1, C, W] bool -> [n, H, C, Dh]."""
    n, H, C, Dh = q.shape
    Hkv = k.shape[1]
    qg = q.reshape(n, Hkv, H // Hkv, C, Dh)
    scores = (qg @ k[:, :, None].swapaxes(-1, -2)).astype(mx.float32) * scale  # [n, Hkv, H/Hkv, C, W]
    scores = mx.where(mask[:, :, None], scores, -mx.inf)
    weights = mx.softmax(scores, axis=-1).astype(v.dtype)
    return (weights @ v[:, :, None]).reshape(n, H, C, Dh)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=int, default=60, help="distinct (rows, chunk, timeline) shapes")
    ap.add_argument("--max-rows", type=int, default=240, help="the most rows one admission takes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    spec, w = decoder.build(smollm2_shaped(30, dtype), dtype)
    L, Hkv, Dh = len(w["layers"]), spec.kv_heads, spec.head_dim
    rng = np.random.default_rng(args.seed)
    # as session 36's refills: 1-240 rows, chunks bucketed, timelines of 512-768 slots
    shapes = sorted({(int(rng.integers(1, args.max_rows + 1)), int(rng.choice([16, 32, 64])),
                      int(rng.choice([512, 576, 640, 704, 768]))) for _ in range(args.shapes)})
    sdpa = mx.fast.scaled_dot_product_attention

    def call(n, C, W, pad_to=1):
        rows = -(-n // pad_to) * pad_to
        tokens = mx.array(rng.integers(0, 49152, size=(rows, C)), dtype=mx.int32)
        padding = mx.zeros((rows,), mx.int32)
        keys = mx.zeros((L, rows, Hkv, W, Dh), dtype)
        values = mx.zeros((L, rows, Hkv, W, Dh), dtype)
        start = mx.array(rng.integers(0, W - C, size=rows), dtype=mx.int32)
        mx.eval(tokens, keys, values, start)
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(*decoder.prefill_after(spec, w, tokens, padding, keys, values, start))
        mx.synchronize()
        return time.perf_counter() - t0

    def attend_with(fn):
        mx.fast.scaled_dot_product_attention = fn

    out = {"device": device_name(), "dtype": str(dtype), "command": " ".join(sys.argv), "shapes": len(shapes),
           "variants": {}}
    for name, fn, pad_to in (("sdpa", sdpa, 1), ("matmul", matmul_attention, 1), ("sdpa8", sdpa, 8)):
        attend_with(fn)
        try:
            call(8, 16, 512, pad_to)  # the variant's own first call (kernels) outside the timings
            first, again = [], []
            for n, C, W in shapes:
                first.append(call(n, C, W, pad_to))
                again.append(call(n, C, W, pad_to))
        finally:
            attend_with(sdpa)
        out["variants"][name] = {"first_ms_median": 1e3 * statistics.median(first),
                                 "again_ms_median": 1e3 * statistics.median(again),
                                 "first_ms_mean": 1e3 * statistics.mean(first),
                                 "again_ms_mean": 1e3 * statistics.mean(again)}
        print(name, json.dumps(out["variants"][name]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
