"""Speed and memory of the nanochat presets on this device, with random weights of the real shapes.

No nanochat checkpoint is needed (none ships offline): the script writes a random-weight nanochat
model of the d20 or d32 shape (65,536-token byte-level BPE vocabulary, nanochat's special tokens)
through the converter's own checks and writers, then runs a few updates of the preset's training
loop on GSM8K prompts and prints seconds per update, its split and peak memory.

Random weights rarely emit a stop token, so every completion runs to max_new_tokens: the figures are
an upper bound for a trained model at the same settings.

    python bench/nanochat_bench.py --size d20 --config configs/nanochat_grpo.toml --data train.jsonl
    python bench/nanochat_bench.py --size d32 --config configs/nanochat_d32.toml --data train.jsonl
    python bench/nanochat_bench.py --size d20 --rollout-precision    # float32 / bf16, plain / 4-bit
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_grpo.base.errors import UserError
from mlx_grpo.commands.train import train
from mlx_grpo.config import build_config, parse_set
from mlx_grpo.models.nanochat import write_nanochat_model
from mlx_grpo.models.nanochat_tokenizer import SPECIAL_TOKENS, TiktokenState

# nanochat's GPTConfig for its speedrun (d20) and largest released (d32) models
SIZES = {
    "d20": {"sequence_len": 2048, "vocab_size": 65536, "n_layer": 20, "n_head": 10, "n_kv_head": 10, "n_embd": 1280},
    "d32": {"sequence_len": 2048, "vocab_size": 65536, "n_layer": 32, "n_head": 16, "n_kv_head": 16, "n_embd": 2048},
    # for a quick check of the script itself (tests/test_bench.py runs it on the CPU)
    "tiny": {"sequence_len": 512, "vocab_size": 1024, "n_layer": 2, "n_head": 2, "n_kv_head": 2, "n_embd": 64},
}
PAT = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""


def synthetic_tokenizer(vocab_size: int, seed: int) -> TiktokenState:
    """A byte-level BPE vocabulary of vocab_size ids: the 256 bytes, then tokens made by joining two
    earlier ones (so each is reachable by a merge), then nanochat's special tokens."""
    rng = np.random.default_rng(seed)
    tokens = [bytes([b]) for b in range(256)]
    seen = set(tokens)
    printable = [bytes([b]) for b in range(32, 127)]
    while len(tokens) < vocab_size - len(SPECIAL_TOKENS):
        left = tokens[rng.integers(256, len(tokens))] if len(tokens) > 256 and rng.random() < 0.7 else \
            printable[rng.integers(len(printable))]
        token = left + printable[rng.integers(len(printable))]
        if token not in seen and len(token) <= 8:
            seen.add(token)
            tokens.append(token)
    ranks = {t: i for i, t in enumerate(tokens)}
    specials = {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
    return TiktokenState("synthetic", PAT, ranks, specials)


def random_nanochat(out: Path, size: str, seed: int = 0) -> Path:
    """A random-weight nanochat model directory as `mlx-grpo convert --nanochat` would write it."""
    config = SIZES[size]
    d, layers = config["n_embd"], config["n_layer"]
    rng = np.random.default_rng(seed)

    def linear(rows, cols):  # nanochat's init scale (c_proj layers get the same, not zeros: real activations)
        return (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(np.float32)

    tensors = {"transformer.wte.weight": rng.standard_normal((config["vocab_size"], d), dtype=np.float32),
               "lm_head.weight": linear(config["vocab_size"], d)}
    for i in range(layers):
        p = f"transformer.h.{i}"
        tensors.update({f"{p}.attn.c_q.weight": linear(d, d), f"{p}.attn.c_k.weight": linear(d, d),
                        f"{p}.attn.c_v.weight": linear(d, d), f"{p}.attn.c_proj.weight": linear(d, d),
                        f"{p}.mlp.c_fc.weight": linear(4 * d, d), f"{p}.mlp.c_proj.weight": linear(d, 4 * d)})
    return write_nanochat_model(out, tensors, config, synthetic_tokenizer(config["vocab_size"], seed),
                                source=f"random {size}", tokenizer_source="synthetic tokenizer", dtype="float32")


def rollout_precision(model_dir: Path, rows: int = 128, tokens: int = 64) -> list[dict]:
    """ms per decode step and memory of one rollout from float32 / bf16 weights, plain and 4-bit."""
    import mlx.nn as nn

    from mlx_grpo.models.model_loading import load_model
    from mlx_grpo.rollout.decode import encode_chat_prompt, generate_rollout
    from mlx_grpo.rollout.rollout_records import SamplingParams

    results = []
    for dtype, bits in [("float32", None), ("float32", 4), ("bfloat16", None), ("bfloat16", 4)]:
        model, tokenizer = load_model(str(model_dir), dtype)
        if bits:
            nn.quantize(model, group_size=64, bits=bits)
        mx.eval(model.parameters())
        prompts = [encode_chat_prompt(tokenizer, f"Question {i}: what is {i}+{i}? " * 8, "", "", 512)[0]
                   for i in range(rows // 16)]
        params = SamplingParams(max_new_tokens=tokens, temperature=1.0, ignore_eos=True)
        generate_rollout(model, tokenizer, prompts, 16, params, mx.random.key(0))  # same shapes: compile, warm up
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        weights = mx.get_active_memory()
        started = time.perf_counter()
        generate_rollout(model, tokenizer, prompts, 16, params, mx.random.key(1))
        mx.synchronize()
        elapsed = time.perf_counter() - started
        results.append({"dtype": dtype, "bits": bits, "rows": rows, "tokens": tokens,
                        "ms_per_step": 1000 * elapsed / tokens, "weights_gb": weights / 1e9,
                        "rollout_extra_gb": (mx.get_peak_memory() - weights) / 1e9})
        print(f"{dtype} {'4-bit' if bits else 'plain'}: {results[-1]['ms_per_step']:.1f} ms/step at {rows} rows, "
              f"+{results[-1]['rollout_extra_gb']:.2f} GB over {weights / 1e9:.2f} GB of weights", flush=True)
        del model
        mx.clear_cache()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="d20")
    parser.add_argument("--config", help="the preset to run (configs/nanochat_*.toml)")
    parser.add_argument("--data", help="GSM8K-form JSONL (train split)")
    parser.add_argument("--rollout-precision", action="store_true",
                        help="instead of training: time rollouts from float32/bf16 weights, plain and 4-bit")
    parser.add_argument("--rows", type=int, default=128, help="rows of the --rollout-precision rollouts (x16)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens decoded in --rollout-precision")
    parser.add_argument("--updates", type=int, default=3, help="optimizer updates to run (the first warms up)")
    parser.add_argument("--set", dest="set_items", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", help="write the JSON record here")
    args = parser.parse_args(argv)
    if args.rollout_precision:
        if args.rows < 16 or args.rows % 16:
            parser.error("--rows must be a positive multiple of 16 (prompts x 16 samples)")
        with tempfile.TemporaryDirectory() as tmp:
            results = rollout_precision(random_nanochat(Path(tmp) / "model", args.size), args.rows, args.tokens)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"size": args.size, "rollout_precision": results}, indent=2) + "\n")
        return 0
    if not (args.config and args.data):
        parser.error("--config and --data are required (unless --rollout-precision)")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            started = time.perf_counter()
            model_dir = random_nanochat(Path(tmp) / "model", args.size)
            build_s = time.perf_counter() - started
            probe = build_config("train", args.config, parse_set(args.set_items))
            per_update = probe.training.batch_size * probe.training.gradient_accumulation_steps
            overrides = [f"model_name={model_dir}", f"dataset_path={args.data}", f"output_dir={tmp}",
                         f"max_train_samples={per_update * args.updates}", "save_steps=0",
                         "eval_every_updates=0", "log_completions_steps=0"] + args.set_items
            cfg = build_config("train", args.config, parse_set(overrides))
            mx.reset_peak_memory()
            run = train(cfg)
            rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    except UserError as exc:
        print(f"nanochat_bench: error: {exc}", file=sys.stderr)
        return 2
    keys = ("time_rollout_s", "time_reward_s", "time_logprob_s", "time_train_s", "rollout_tokens_per_s",
            "peak_memory_gb", "completion_length_mean")
    print("| update | s/update | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 2) + "|")
    for r in rows:
        total = sum(r.get(k, 0.0) for k in keys[:4])
        print(f"| {r['update_step']} | {total:.1f} | " + " | ".join(f"{r.get(k, float('nan')):.2f}" for k in keys) + " |")
    record = {"size": args.size, "config": args.config, "overrides": args.set_items, "build_model_s": build_s,
              "device": str(mx.default_device()), "mlx": mx.__version__, "platform": platform.platform(),
              "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
