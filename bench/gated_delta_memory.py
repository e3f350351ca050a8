"""Peak memory of the forward+backward of ONE gated-delta layer (mlx-lm qwen3_5 GatedDeltaNet) against ONE
attention layer of the same width (qwen3_5's full-attention layer), both at Qwen3.5-0.8B's real configuration,
the gated-delta layer through mlx-lm's reference scan (autograd through the ops path) and through
mlx_grpo.models.gated_delta's training path (bounded_scan: the chunked form for scalar gates, else the bounded scan).

Qwen3.5-0.8B (HF config): hidden_size 1024; gated DeltaNet: 16 value heads, 16 key heads, key/value head dim 128,
conv kernel 4; gated attention: 8 query heads, 2 KV heads, head_dim 256, partial rotary 0.25.

Each measurement runs in a fresh process (MLX's peak counter and buffer cache belong to the process): build the
layer (weights in --dtype), a random input [batch, tokens, 1024], then mx.reset_peak_memory() and one
value_and_grad of sum(layer(x) * w) w.r.t. the layer's weights and x, evaluated. "peak" is mx.get_peak_memory();
"added" is the peak minus what was allocated before (weights, input). Layers run in training mode: in eval mode
mlx-lm would pick its Metal kernel on a Mac GPU, which has no VJP. The bounded run is also checked against the
reference: the same loss, and gradients within float tolerance.

    python bench/gated_delta_memory.py --out bench-results/gated_delta_memory.json        # 1,024 and 4,096, bf16
    python bench/gated_delta_memory.py --tokens 256 --dtype float32 --out /tmp/gdm.json   # a quick CPU check

Prints a markdown table (GiB = 2^30 bytes) and writes the JSON record to --out (a .json path, or a directory).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_util import device_name, versions, write_record  # noqa: E402

GIB = 1024 ** 3
QWEN3_5_0_8B = {
    "model_type": "qwen3_5_text", "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 24,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256, "rms_norm_eps": 1e-6,
    "vocab_size": 248320, "max_position_embeddings": 262144, "linear_num_value_heads": 16,
    "linear_num_key_heads": 16, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "mrope_section": [11, 11, 10], "rope_theta": 10000000,
                        "partial_rotary_factor": 0.25},
}
CASES = [("attention", "-"), ("gated_delta", "bounded"), ("gated_delta", "reference")]


def build(kind: str, dtype):
    from mlx_lm.models import qwen3_5

    args = qwen3_5.TextModelArgs.from_dict(json.loads(json.dumps(QWEN3_5_0_8B)))
    mx.random.seed(0)
    layer = qwen3_5.GatedDeltaNet(args) if kind == "gated_delta" else qwen3_5.Attention(args)
    layer.set_dtype(dtype)
    layer.train()  # use_kernel=False: the only differentiable mlx-lm path
    return layer


def one(kind: str, variant: str, tokens: int, batch: int, dtype_name: str, check: bool) -> dict:
    """One measurement (run in a child process); -> its figures."""
    from contextlib import nullcontext

    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mlx_grpo.models.gated_delta import bounded_scan

    dtype = getattr(mx, dtype_name)
    layer = build(kind, dtype)
    x = mx.random.normal((batch, tokens, QWEN3_5_0_8B["hidden_size"])).astype(dtype)
    w = mx.random.normal(x.shape)
    mask = "causal" if kind == "attention" else None

    def loss(layer, x):
        return (layer(x, mask).astype(mx.float32) * w[:, :x.shape[1]]).sum()

    grad = nn.value_and_grad(layer, loss)
    scoped = lambda: bounded_scan(layer) if variant == "bounded" else nullcontext()  # noqa: E731
    small = x[:, :16]
    with scoped():  # warm-up on 16 tokens: compiles the step functions outside the timed, measured run
        mx.eval(grad(layer, small))
    mx.eval(layer.parameters(), x, w)
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    t0 = time.perf_counter()
    with scoped():
        value, grads = grad(layer, x)
        mx.eval(value, grads)
    seconds = time.perf_counter() - t0
    peak = mx.get_peak_memory()
    row = {"layer": kind, "variant": variant, "tokens": tokens, "batch": batch, "dtype": dtype_name,
           "peak_gib": peak / GIB, "added_gib": (peak - base) / GIB, "seconds": seconds, "loss": value.item()}
    if check:  # the bounded scan against the reference, on the same layer and input (after the measurement)
        del grads
        mx.clear_cache()
        ref_value, ref_grads = grad(layer, x)
        mx.eval(ref_value, ref_grads)
        with scoped():
            value, grads = grad(layer, x)
            mx.eval(value, grads)
        diffs = [(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max()
                  / (mx.abs(b.astype(mx.float32)).max() + 1e-12)).item()
                 for (_, a), (_, b) in zip(tree_flatten(grads), tree_flatten(ref_grads))]
        row.update(same_loss=value.item() == ref_value.item(), max_grad_rel_diff=max(diffs))
    return row


def child(kind, variant, tokens, args) -> dict:
    cmd = [sys.executable, __file__, "--one", f"{kind}:{variant}:{tokens}", "--batch", str(args.batch),
           "--dtype", args.dtype] + (["--check"] if args.check and variant == "bounded" else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:  # e.g. out of memory: report it, keep going
        return {"layer": kind, "variant": variant, "tokens": tokens, "error": proc.stderr.strip()[-500:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    lines = ["| tokens | layer | scan | peak GiB | added GiB | x attention (added) | seconds | check |",
             "|---:|---|---|---:|---:|---:|---:|---|"]
    attention = {r["tokens"]: r.get("added_gib") for r in rows if r["layer"] == "attention"}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['tokens']} | {r['layer']} | {r['variant']} | error: {r['error'][-80:]} | | | | |")
            continue
        ratio = r["added_gib"] / attention[r["tokens"]] if attention.get(r["tokens"]) else float("nan")
        check = ("" if "same_loss" not in r else
                 f"loss {'=' if r['same_loss'] else '!='}, grad rel diff {r['max_grad_rel_diff']:.1e}")
        lines.append(f"| {r['tokens']} | {r['layer']} | {r['variant']} | {r['peak_gib']:.3f} | {r['added_gib']:.3f} "
                     f"| {ratio:.2f} | {r['seconds']:.2f} | {check} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1024,4096", help="comma-separated sequence lengths")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--skip-reference", action="store_true", help="leave out the (large) reference scan")
    ap.add_argument("--check", action="store_true", help="also compare the bounded scan's loss and gradients "
                    "with the reference's in the bounded run's process (needs the reference's memory)")
    ap.add_argument("--out", help="where to write the JSON record (a .json file, or a directory)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # child: layer:variant:tokens
    args = ap.parse_args(argv)
    if args.one:
        kind, variant, tokens = args.one.split(":")
        print(json.dumps(one(kind, variant, int(tokens), args.batch, args.dtype, args.check)))
        return 0

    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        for kind, variant in CASES:
            if variant == "reference" and args.skip_reference:
                continue
            rows.append(child(kind, variant, tokens, args))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(table(rows))
    record = {"bench": "gated_delta_memory", "config": QWEN3_5_0_8B, "rows": rows, "device": device_name(),
              "versions": versions(), "date": dt.datetime.now().isoformat(timespec="seconds")}
    if args.out:
        print(f"\nJSON: {write_record(args.out, 'gated_delta_memory', record)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
