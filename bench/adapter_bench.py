"""Peak memory and seconds per update of full, LoRA, DoRA and QLoRA GRPO training of the same model on
the same workload, each variant in a fresh process.

MLX's peak-memory counter and buffer cache belong to the process, so a fair peak needs a new one: the
script runs itself once per variant (`--one VARIANT`, hidden) and each child runs a whole
`mlx_grpo.commands.train.train(cfg)` on a small fixed GRPO workload, then reports

  * the peak memory of the run (mx.get_peak_memory(), load included) and the peak after loading (the
    counter is reset once the trainer is built: rollouts, log-prob passes, updates),
  * the memory of the loaded weights (nbytes of the model's parameters, of its trainable ones, and of the
    frozen reference copy that full training keeps for the KL term), the AdamW state, the count of
    trainable parameters and of quantized layers,
  * the median seconds per update and its split (rollout / rewards / log-prob passes / train) from the
    run's metrics.jsonl, the first update left out as warm-up when there are two or more.

Variants: full (every weight, learning_rate 1e-6), lora, dora (adapters on every projection of every
block, rank 16, alpha 32, learning_rate 1e-5), qlora8 / qlora4 / qdora4 (the same adapters on a base
quantized to 8 / 4 bits, group 64, at load time). The learning rates only follow the README's advice
(adapters take ~10x full's); memory and time do not depend on them. With kl_coeff > 0 the reference pass
is part of every figure: a second copy of the weights for full, the adapters switched off for the others.

Workload (the defaults, each overridable with --set for every variant): batch_size 4 prompts x
num_generations 8 completions, max_new_tokens 128, kl_coeff 0.04, the data truncated to exactly
--updates updates, no checkpoints but the final one (in a temporary directory), no completion logs.
GB is 10^9 bytes, as in metrics.jsonl.

    python bench/adapter_bench.py --json bench-results/adapter_bench.json
    python bench/adapter_bench.py --data ../shared/data/gsm8k/train.jsonl --updates 3 \\
        --json bench-results/adapter_bench-gsm8k.json
    python bench/adapter_bench.py --updates 2 --set max_new_tokens=64 --set batch_size=2 \\
        --set num_generations=4          # a quick check on a CPU

Prints a markdown table and the ratios QLoRA-4 peak / LoRA peak and LoRA peak / full peak; --json writes
the record (device, versions, workload, every variant's figures).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# No mlx.core at the top: the optimized-BLAS choice (mlx_grpo.base.blas) must come before its first import.
from mlx_grpo.base.blas import use_optimized_blas
from mlx_grpo.base.errors import UserError
from mlx_grpo.config import DEFAULT_MODEL, build_config, parse_set

PROG = "adapter_bench"
GB = 1e9  # as metrics.jsonl's peak_memory_gb
FULL_LR, ADAPTER_LR = 1e-6, 1e-5
# name -> (train_type, load_in_bits, learning_rate)
VARIANTS = {
    "full": ("full", 0, FULL_LR),
    "lora": ("lora", 0, ADAPTER_LR),
    "qlora8": ("lora", 8, ADAPTER_LR),
    "qlora4": ("lora", 4, ADAPTER_LR),
    "dora": ("dora", 0, ADAPTER_LR),
    "qdora4": ("dora", 4, ADAPTER_LR),
}
DEFAULT_VARIANTS = "full,lora,qlora8,qlora4"
WORKLOAD = ["batch_size=4", "num_generations=8", "max_new_tokens=128", "kl_coeff=0.04", "save_steps=0",
            "log_completions_steps=0", "eval_every_updates=0", "eval_steps=0", "num_epochs=1"]
# Keys that only exist for adapters: a --set of one applies to the adapter variants, not to full.
ADAPTER_ONLY = ("lora_rank", "lora_alpha", "lora_dropout", "lora_layers", "lora_keys")
# Keys the benchmark sets itself, and the flag that sets each.
OWNED = {"train_type": "--variants", "load_in_bits": "--variants (qlora8, qlora4, qdora4)", "model_name": "--model",
         "model_dtype": "--model-dtype", "dataset_path": "--data", "dataset": "--data",
         "output_dir": "nothing (runs go to a temporary directory)", "run_name": "nothing (one run per variant)"}
ERROR_PREFIX = f"{PROG}: error: "


# ----------------------------------------------------------------------------- configuration

def parse_variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        raise UserError(f"unknown variant(s) {', '.join(unknown) or '(none given)'}; choose from "
                        f"{', '.join(VARIANTS)}")
    if len(set(names)) != len(names):
        raise UserError(f"--variants names a variant twice: {text}")
    return names


def user_sets(items: list[str], variant: str) -> list[str]:
    """The --set items that apply to `variant` (adapter-only keys skip full), after refusing the keys
    the benchmark owns."""
    out = []
    for item, (key, _) in zip(items, parse_set(items)):
        if key in OWNED:
            raise UserError(f"--set {key}=...: the benchmark sets {key} itself; use {OWNED[key]}")
        if not (VARIANTS[variant][0] == "full" and key in ADAPTER_ONLY):
            out.append(item)
    return out


def variant_overrides(args: argparse.Namespace, variant: str, output_dir: str) -> list[str]:
    """The `--set` list of one variant's run: workload < variant < the user's --set; the data cut to
    exactly --updates updates unless the user set max_train_samples."""
    train_type, bits, lr = VARIANTS[variant]
    head = [f"model_name={args.model}", f"model_dtype={args.model_dtype}",
            f"dataset_path={args.data}" if args.data else "dataset=arith", f"output_dir={output_dir}",
            f"run_name={variant}", *WORKLOAD, f"train_type={train_type}", f"learning_rate={lr}"]
    if bits:
        head.append(f"load_in_bits={bits}")
    tail = user_sets(args.set_items, variant)
    probe = build_config("train", overrides=parse_set(head + tail))
    per_update = probe.training.batch_size * probe.training.gradient_accumulation_steps
    return head + [f"max_train_samples={per_update * args.updates}"] + tail


def check_inputs(args: argparse.Namespace, variants: list[str]) -> None:
    """Everything that can be checked before a child starts: keys and values of every variant's config,
    the model path, the data file and its size."""
    from mlx_grpo.data.examples import load_examples
    from mlx_grpo.models.model_loading import resolve_model_path

    configs = [build_config("train", overrides=parse_set(variant_overrides(args, v, "unused"))) for v in variants]
    resolve_model_path(args.model)  # a missing directory is one line here; the default converts once
    cfg = configs[0]
    examples = load_examples(cfg.data.dataset, "train", cfg.data.dataset_path or None, cfg.run.seed)
    needed = max(c.data.max_train_samples for c in configs)
    if len(examples) < needed:
        raise UserError(f"{args.data or 'arith'} has {len(examples)} examples; {args.updates} updates of "
                        f"{needed // args.updates} prompts need {needed}: lower --updates or batch_size")


# ----------------------------------------------------------------------------- one variant (child)

def device_info(mx) -> dict:
    import mlx_lm

    if mx.default_device() == mx.gpu and sys.platform == "darwin":
        name = f"{platform.machine()} GPU (Metal)"
    elif mx.default_device() == mx.gpu:
        name = "GPU"
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10)
            if out.returncode == 0 and out.stdout.strip():
                name = out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError):
            pass
    else:
        name = f"CPU ({platform.processor() or platform.machine()})"
    return {"device": name, "versions": {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
                                         "python": platform.python_version()}, "platform": platform.platform()}


def run_one(args: argparse.Namespace, blas: str | None) -> dict:
    """Train one variant in this (fresh) process and measure it."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    import mlx_grpo.commands.train as run_module

    def nbytes(tree) -> int:
        return sum(a.nbytes for _, a in tree_flatten(tree))

    measured: dict = {}
    build_job = run_module.build_job

    def build_and_measure(cfg, world=None):
        """The trainer's own build, then the weights it holds and the peak of loading them; the peak
        counter restarts for the training itself."""
        job = build_job(cfg, world)
        model, reference = job.model, job.trainer.policies.reference
        mx.eval(model.parameters(), reference.parameters() if reference is not None else [])
        trainable = model.trainable_parameters()
        measured.update(
            job=job, model_bytes=nbytes(model.parameters()), trainable_bytes=nbytes(trainable),
            trainable_params=sum(a.size for _, a in tree_flatten(trainable)),
            reference_bytes=nbytes(reference.parameters()) if reference is not None else 0,
            quantized_layers=sum(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
                                 for _, m in model.named_modules()),
            load_peak=mx.get_peak_memory(), active_after_load=mx.get_active_memory())
        mx.reset_peak_memory()
        return job

    with tempfile.TemporaryDirectory(prefix="adapter_bench-") as tmp:
        cfg = build_config("train", overrides=parse_set(variant_overrides(args, args.one, tmp)))
        mx.reset_peak_memory()
        run_module.build_job = build_and_measure  # train() looks the name up at call time
        try:
            started = time.perf_counter()
            run_dir = run_module.train(cfg)
            wall = time.perf_counter() - started
        finally:
            run_module.build_job = build_job
        train_peak = mx.get_peak_memory()
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not rows:
        raise UserError(f"{args.one}: the run made no update (is the data large enough?)")
    optimizer_bytes = nbytes(measured["job"].trainer.optimizer.state)
    warm = rows[1:] if len(rows) >= 2 else rows

    def median(key: str) -> float:
        return statistics.median(float(r[key]) for r in warm)

    split = ("time_rollout_s", "time_reward_s", "time_logprob_s", "time_train_s")
    train_type, bits, _ = VARIANTS[args.one]
    return {
        "variant": args.one, "train_type": train_type, "load_in_bits": bits,
        "learning_rate": cfg.optimizer.learning_rate,
        "lora_rank": cfg.model.lora_rank if train_type != "full" else None,
        "trainable_params": measured["trainable_params"], "quantized_layers": measured["quantized_layers"],
        "weights_gb": measured["model_bytes"] / GB, "trainable_weights_gb": measured["trainable_bytes"] / GB,
        "reference_weights_gb": measured["reference_bytes"] / GB, "optimizer_state_gb": optimizer_bytes / GB,
        "active_after_load_gb": measured["active_after_load"] / GB,
        "peak_gb": max(measured["load_peak"], train_peak) / GB, "peak_load_gb": measured["load_peak"] / GB,
        "peak_after_load_gb": train_peak / GB,
        "updates": len(rows), "timed_updates": [r["update_step"] for r in warm],
        "s_per_update": statistics.median(sum(float(r[k]) for k in split) for r in warm),
        "rollout_s": median("time_rollout_s"), "reward_s": median("time_reward_s"),
        "logprob_s": median("time_logprob_s"), "train_s": median("time_train_s"),
        "rollout_tokens_per_s": median("rollout_tokens_per_s"), "train_tokens_per_s": median("train_tokens_per_s"),
        "completion_length_mean": median("completion_length_mean"),
        "losses": [r["loss"] for r in rows], "kl": [r["kl"] for r in rows],
        "skipped_updates": rows[-1]["skipped_total"], "wall_s": wall, "blas": blas, **device_info(mx),
    }


# ----------------------------------------------------------------------------- all variants (parent)

def child_command(args: argparse.Namespace, variant: str, result: Path) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--model", args.model, "--model-dtype", args.model_dtype,
           "--updates", str(args.updates), "--one", variant, "--result", str(result)]
    if args.data:
        cmd += ["--data", args.data]
    for item in args.set_items:
        cmd += ["--set", item]
    return cmd


def run_variant(args: argparse.Namespace, variant: str, tmp: Path) -> dict:
    result = tmp / f"{variant}.json"
    proc = subprocess.run(child_command(args, variant, result), text=True, stderr=subprocess.PIPE,
                          stdout=None if args.verbose else subprocess.PIPE)
    errors = [line for line in proc.stderr.splitlines() if line.startswith(ERROR_PREFIX)]
    if proc.returncode == 2 and errors:  # the child's UserError: bad input, the same for every variant
        raise UserError(f"{variant}: {errors[-1][len(ERROR_PREFIX):]}")
    if proc.returncode != 0 or not result.is_file():
        # A crash (out of memory, say) is a result for this variant; the others still run.
        lines = [line for line in proc.stderr.splitlines() if line.strip()] or ["(no error output)"]
        print(f"{PROG}: {variant} failed (exit code {proc.returncode}): {lines[-1]}", file=sys.stderr, flush=True)
        if args.verbose:
            print("\n".join(lines[-30:]), file=sys.stderr, flush=True)
        return {"variant": variant, "error": lines[-1], "exit_code": proc.returncode}
    return json.loads(result.read_text())


def gb(value: float) -> str:
    return f"{value:.3f}" if value >= 0.01 else f"{value:.2g}"


def markdown(results: list[dict]) -> str:
    lines = ["| variant | trainable params | weights GB | peak GB | peak after load GB | s/update | rollout s | "
             "train s |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error']} | | | | | | |")
            continue
        weights = gb(r["weights_gb"])
        if r["reference_weights_gb"]:
            weights += f" (+{gb(r['reference_weights_gb'])} ref)"
        if r["quantized_layers"]:
            weights += f", {r['quantized_layers']} layers {r['load_in_bits']}-bit"
        lines.append(f"| {r['variant']} | {r['trainable_params']:,} | {weights} | {gb(r['peak_gb'])} | "
                     f"{gb(r['peak_after_load_gb'])} | {r['s_per_update']:.2f} | {r['rollout_s']:.2f} | "
                     f"{r['train_s']:.2f} |")
    return "\n".join(lines)


def ratios(results: list[dict]) -> dict[str, float]:
    ok = {r["variant"]: r for r in results if "error" not in r}
    out = {}
    for num, den in (("qlora4", "lora"), ("qlora8", "lora"), ("lora", "full"), ("qlora4", "full")):
        if num in ok and den in ok:
            for key, tag in (("peak_gb", "peak"), ("peak_after_load_gb", "peak_after_load")):
                if ok[den][key] > 0:
                    out[f"{num}_{tag}_over_{den}"] = ok[num][key] / ok[den][key]
    return out


def run_all(args: argparse.Namespace, argv: list[str] | None) -> int:
    variants = parse_variants(args.variants)
    check_inputs(args, variants)
    results = []
    with tempfile.TemporaryDirectory(prefix="adapter_bench-") as tmp:
        for i, variant in enumerate(variants, 1):
            print(f"[{PROG}] {variant} ({i}/{len(variants)}) ...", flush=True)
            r = run_variant(args, variant, Path(tmp))
            if "error" not in r:
                print(f"[{PROG}] {variant}: peak {r['peak_gb']:.3f} GB, {r['s_per_update']:.2f} s/update "
                      f"({r['updates']} updates, {r['wall_s']:.0f} s)", flush=True)
            results.append(r)
    first = next((r for r in results if "error" not in r), {})
    workload = build_config("train", overrides=parse_set(variant_overrides(args, variants[0], "unused")))
    record = {
        "date": dt.date.today().isoformat(), "device": first.get("device"), "versions": first.get("versions"),
        "platform": first.get("platform"), "blas": first.get("blas"),
        "command": " ".join([Path(sys.argv[0]).as_posix()] + (argv if argv is not None else sys.argv[1:])),
        "workload": {"model": args.model, "model_dtype": args.model_dtype, "data": args.data or "arith",
                     "updates": args.updates, "set": args.set_items, "batch_size": workload.training.batch_size,
                     "num_generations": workload.rollout.num_generations,
                     "max_new_tokens": workload.rollout.max_new_tokens, "kl_coeff": workload.objective.kl_coeff,
                     "gradient_accumulation_steps": workload.training.gradient_accumulation_steps,
                     "micro_batch_size": workload.training.micro_batch_size,
                     "micro_batch_tokens": workload.training.micro_batch_tokens},
        "variants": results, "ratios": ratios(results),
    }
    print()
    print(f"device: {record['device']}; mlx {(record['versions'] or {}).get('mlx')}; BLAS {record['blas'] or 'MLX default'}"
          f"; model {args.model} ({args.model_dtype}); B={workload.training.batch_size} "
          f"G={workload.rollout.num_generations} "
          f"max_new_tokens={workload.rollout.max_new_tokens} kl_coeff={workload.objective.kl_coeff}")
    print()
    print(markdown(results))
    print()
    ratio = record["ratios"]
    for name, value in ratio.items():
        # The peak after loading differs from the run's only where loading peaks higher (big models,
        # the float weights before QLoRA quantizes them): print it then.
        whole = name.replace("_peak_after_load_", "_peak_")
        if name == whole or abs(value - ratio[whole]) > 0.005:
            print(f"{name.replace('_over_', ' / ').replace('_', ' ')}: {value:.3f}")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2) + "\n")
        print(f"\nJSON: {path}")
    return 1 if any("error" in r for r in results) else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="model name or MLX model directory")
    ap.add_argument("--model-dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"],
                    help="dtype of the float weights after loading (default float32, as the default model trains)")
    ap.add_argument("--data", default="", help="GSM8K-style JSONL/Parquet training file (default: built-in arith)")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--updates", type=int, default=3, help="optimizer updates per variant (the first warms up)")
    ap.add_argument("--set", dest="set_items", action="append", default=[], metavar="KEY=VALUE",
                    help="trainer config override for every variant (lora_* keys: the adapter variants only)")
    ap.add_argument("--json", help="write the JSON record here")
    ap.add_argument("--verbose", action="store_true", help="show each run's training output")
    ap.add_argument("--one", choices=sorted(VARIANTS), help=argparse.SUPPRESS)  # child: run one variant
    ap.add_argument("--result", help=argparse.SUPPRESS)  # child: where to write its figures
    args = ap.parse_args(argv)
    if args.updates < 1:
        ap.error("--updates must be >= 1")
    if bool(args.one) != bool(args.result):
        ap.error("--one and --result go together (the script passes them to its own child processes)")
    try:
        blas = use_optimized_blas()  # before mlx.core is imported, as the CLI does
        if args.one:
            result = run_one(args, blas)
            Path(args.result).write_text(json.dumps(result, indent=2) + "\n")
            return 0
        return run_all(args, argv)
    except UserError as exc:  # bad model/data path, config key or value: one line, like the CLI
        print(f"{ERROR_PREFIX}{exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
