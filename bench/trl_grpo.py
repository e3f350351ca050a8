"""Seconds per GRPO step of Hugging Face TRL's GRPOTrainer on the workload of bench/grpo_bench.py, for
comparison with mlx-grpo on the same machine.

TRL in PyTorch with its default generation (transformers `model.generate`, no vLLM), full fine-tuning.
Standard workload (the defaults): SmolLM2-135M-Instruct in bf16, 16 GSM8K prompts x 16 completions per
optimizer step (256 completions, one generation round per step), 256 new tokens, temperature 1.0, the XML
system prompt, the five built-in mlx-grpo rewards, KL coefficient 0.04, learning rate 1e-6.

    python3 bench/trl_grpo.py --model MODEL_DIR --data GSM8K_TRAIN.jsonl --out bench-results/trl_grpo.json

MODEL_DIR is a Hugging Face-format llama directory (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json), e.g. what `mlx-grpo convert` / the default-model cache
(~/.cache/mlx-grpo/models/smollm2-135m-instruct-float32) holds for the default model. Loading is offline.

The time of a step is the wall time between the ends of two consecutive optimizer steps (CUDA
synchronised): generation, rewards, reference/old log-probs, forward/backward, AdamW and TRL's logging.
The first step (CUDA/cuBLAS warm-up) is excluded from the mean. TRL's own `step_time` metric (the time in
`training_step`, i.e. without the optimizer step) is recorded beside it.

Needs: torch, transformers, accelerate, trl, datasets (TRL requires a `datasets.Dataset`). It does not
need mlx: the rewards, the system prompt and the GSM8K answer parser are imported from this repository's
src/mlx_grpo (rewards/, config/, data/examples.py, base/cache.py and base/errors.py import only the standard
library and numpy).
"""

from __future__ import annotations

import os

# Never reach for the hub: everything is local.
for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import argparse
import datetime as dt
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

# mlx-free modules of this repository (no mlx import anywhere in them; see the module docstring).
from mlx_grpo.base.cache import cache_root  # noqa: E402
from mlx_grpo.config import BUILTIN_REWARD_NAMES, SYSTEM_PROMPT  # noqa: E402
from mlx_grpo.data.examples import parse_gsm8k_answer  # noqa: E402
from mlx_grpo.rewards.builtin import BUILTIN_REWARDS  # noqa: E402

# mlx-grpo's default-model cache ($MLX_GRPO_CACHE or ~/.cache/mlx-grpo), where the first mlx-grpo run converts it
DEFAULT_MODEL_DIR = cache_root() / "models" / "smollm2-135m-instruct-float32"
DEFAULT_DATA = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"


# ----------------------------------------------------------------------------- inputs

def prepare_model_dir(model: str, workdir: Path) -> str:
    """The directory transformers will load: `model` itself, or a patched copy of its config.

    The project's GGUF converter (src/mlx_grpo/models/gguf.py build_config) writes model_type "llama",
    architectures ["LlamaForCausalLM"] and torch_dtype, and HF tensor names in model.safetensors, which
    transformers loads as is. For a directory whose config.json lacks `architectures` (or has neither
    `dtype` nor `torch_dtype`), the missing fields are added in a temporary copy of config.json next to
    symlinks of the other files; the original directory is never modified.
    """
    src = Path(model).expanduser().resolve()
    cfg_path = src / "config.json"
    if not src.is_dir():
        sys.exit(f"trl_grpo: model directory not found: {src}")
    if not cfg_path.is_file():
        sys.exit(f"trl_grpo: {src} has no config.json (give a Hugging Face-format model directory)")
    config = json.loads(cfg_path.read_text())
    if "quantization" in config or "quantization_config" in config:
        sys.exit(f"trl_grpo: {src} is a quantized (MLX) model; give an unquantized float32/bf16 directory")
    patch = {}
    if not config.get("architectures"):
        if config.get("model_type") != "llama":
            sys.exit(f"trl_grpo: {cfg_path} has no 'architectures' and model_type {config.get('model_type')!r}")
        patch["architectures"] = ["LlamaForCausalLM"]
    if "dtype" not in config and "torch_dtype" not in config:
        patch["torch_dtype"] = "float32"
    if not patch:
        return str(src)
    dst = workdir / "model"
    dst.mkdir(parents=True)
    for item in src.iterdir():
        if item.name != "config.json":
            (dst / item.name).symlink_to(item)
    (dst / "config.json").write_text(json.dumps({**config, **patch}, indent=2))
    print(f"trl_grpo: patched config.json in a temporary copy ({', '.join(patch)}): {dst}", flush=True)
    return str(dst)


def load_gsm8k(path: str, limit: int) -> list[dict]:
    """GSM8K rows {"question", "answer": "... #### 42"} -> [{"question", "answer": "42"}] (first `limit`)."""
    rows = []
    if not Path(path).is_file():
        sys.exit(f"trl_grpo: data file not found: {path}")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "question" not in row or "answer" not in row:
                sys.exit(f"trl_grpo: {path}:{lineno}: expected GSM8K keys 'question' and 'answer'")
            rows.append({"question": row["question"], "answer": parse_gsm8k_answer(row["answer"])})
            if limit and len(rows) >= limit:
                break
    if not rows:
        sys.exit(f"trl_grpo: no rows in {path}")
    return rows


def build_dataset(rows: list[dict], tokenizer, system_prompt: str, prefill: str):
    """The TRL training set: column "prompt" plus "answer" (the gold answer, passed on to the rewards).

    Without a prefill, prompts are chat messages (system + user) that TRL renders with the tokenizer's
    chat template and add_generation_prompt=True. With a prefill (mlx-grpo's `prefill`, e.g. prod.toml's
    "<reasoning>\\n"), TRL 1.16 cannot continue an assistant message (it always adds a generation prompt),
    so the prompt is the rendered template + prefill as text, exactly the tokens mlx-grpo's
    encode_chat_prompt builds; the rewards then see prefill + completion, as in mlx-grpo.
    """
    from datasets import Dataset

    records = []
    for r in rows:
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": r["question"]}]
        if prefill:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            records.append({"prompt": text + prefill, "answer": r["answer"]})
        else:
            records.append({"prompt": messages, "answer": r["answer"]})
    return Dataset.from_list(records)


def reward_functions(names: list[str], prefill: str) -> list:
    """mlx-grpo's built-in rewards (same code), named as in mlx-grpo so TRL logs rewards/<name>/mean.

    TRL calls fn(prompts=, completions=, completion_ids=, **columns, trainer_state=, log_extra=,
    log_metric=): the same TRL-like signature, the extra keywords land in **columns. Completions are
    strings (text prompts) or [{"role": "assistant", ...}] lists (chat prompts); both are handled by
    rewards._text. A prefill is put back in front of each completion, as mlx-grpo's rewards see it.
    """
    funcs = []
    for name in names:
        fn = BUILTIN_REWARDS[name]

        def wrapped(prompts, completions, completion_ids, _fn=fn, **columns):
            if prefill:
                completions = [prefill + c if isinstance(c, str) else
                               [{**c[-1], "content": prefill + c[-1]["content"]}] for c in completions]
            return _fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)

        wrapped.__name__ = wrapped.__qualname__ = name
        funcs.append(wrapped)
    return funcs


# ----------------------------------------------------------------------------- timing

def _num(value, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def make_timer(torch):
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Wall time of each optimizer step (CUDA synchronised at the step boundaries) and its TRL logs."""

        def __init__(self):
            self.begin: dict[int, float] = {}
            self.end: dict[int, float] = {}
            self.logs: dict[int, dict] = {}

        @staticmethod
        def now() -> float:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin[state.global_step + 1] = self.now()

        def on_step_end(self, args, state, control, **kwargs):
            self.end[state.global_step] = self.now()

        def on_log(self, args, state, control, logs=None, **kwargs):
            step = state.global_step
            self.logs.setdefault(step, {}).update(logs or {})
            if step in self.end and "step_time" in (logs or {}):
                rec = self.record(step)
                print(f"step {step}{' (warm-up)' if step == 1 else ''}: {rec['wall_s']:.2f} s "
                      f"(TRL step_time {_num(rec['trl_step_time_s'], 2)} s); "
                      f"completion mean length {_num(rec['completion_mean_length'], 1)}, "
                      f"reward {_num(rec['reward'], 3)}, kl {_num(rec['kl'], 5)}", flush=True)

        def record(self, step: int) -> dict:
            logs = self.logs.get(step, {})
            start = self.end[step - 1] if step - 1 in self.end else self.begin[step]
            return {
                "step": step,
                "wall_s": self.end[step] - start,
                "inner_s": self.end[step] - self.begin[step],
                "trl_step_time_s": logs.get("step_time"),
                "completion_mean_length": logs.get("completions/mean_length"),
                "completion_clipped_ratio": logs.get("completions/clipped_ratio"),
                "reward": logs.get("reward"),
                "reward_std": logs.get("reward_std"),
                "kl": logs.get("kl"),
                "loss": logs.get("loss"),
                "grad_norm": logs.get("grad_norm"),
                "logs": logs,
            }

    return StepTimer()


def versions(torch) -> dict:
    import accelerate
    import datasets
    import transformers
    import trl

    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "trl": trl.__version__,
            "accelerate": accelerate.__version__, "datasets": datasets.__version__}


def device_name(torch) -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL_DIR),
                    help="Hugging Face-format model directory (llama); default: mlx-grpo's converted default "
                         "model, %(default)s")
    ap.add_argument("--data", default=str(DEFAULT_DATA),
                    help="GSM8K JSONL file ({'question', 'answer': '... #### N'}); default %(default)s")
    ap.add_argument("--out", default="bench-results",
                    help="JSON result: a file path ending in .json, or a directory (trl_grpo-<time>.json in it)")
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps; the first is warm-up (default 5)")
    ap.add_argument("--num-prompts", type=int, default=16, help="prompts per optimizer step (B)")
    ap.add_argument("--num-generations", type=int, default=16, help="completions per prompt (G)")
    ap.add_argument("--max-completion-length", type=int, default=256, help="max new tokens per completion")
    ap.add_argument("--micro-batch-size", type=int, default=32,
                    help="completions per forward/backward (TRL per_device_train_batch_size); B*G must be a "
                         "multiple; gradient_accumulation_steps = B*G / this (default 32, as prod.toml)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="weights dtype of policy and reference (bfloat16 also turns on TRL's bf16 autocast)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--learning-rate", type=float, default=1e-6)
    ap.add_argument("--beta", type=float, default=0.04, help="KL coefficient (mlx-grpo kl_coeff)")
    ap.add_argument("--prefill", default="",
                    help="text after the generation prompt, as mlx-grpo's `prefill` (prod.toml: '<reasoning>\\n'); "
                         "default none, as bench/grpo_bench.py")
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="TRL's default is on; off here by default (mlx-grpo does not recompute activations)")
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args(argv)

    total = args.num_prompts * args.num_generations
    micro = min(args.micro_batch_size, total)
    if total % micro:
        ap.error(f"--micro-batch-size {micro} must divide num_prompts x num_generations = {total}")
    if args.num_generations < 2:
        ap.error("--num-generations must be >= 2 (GRPO normalises within each group)")

    import torch
    import trl
    from transformers import AutoTokenizer, PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    workdir = Path(tempfile.mkdtemp(prefix="trl_grpo-"))
    model_dir = prepare_model_dir(args.model, workdir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left", truncation_side="left")
    rows = load_gsm8k(args.data, 0)
    train_dataset = build_dataset(rows, tokenizer, SYSTEM_PROMPT, args.prefill)
    rewards = reward_functions(list(BUILTIN_REWARD_NAMES), args.prefill)

    use_cpu = not torch.cuda.is_available()
    config = GRPOConfig(
        output_dir=str(workdir / "out"),
        # the workload
        max_steps=args.steps,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=total // micro,  # one optimizer step = B*G completions
        # generation_batch_size defaults to per_device_train_batch_size * steps_per_generation (=
        # gradient_accumulation_steps): one generate() of all B*G completions per optimizer step.
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        model_init_kwargs={"dtype": args.dtype},
        bf16=args.dtype == "bfloat16",
        use_cpu=use_cpu,
        gradient_checkpointing=args.gradient_checkpointing,
        # the objective, as mlx-grpo's (src/mlx_grpo/loss.py): per-sequence mean of the clipped token loss
        # with k3 KL to the frozen reference, group-normalised advantages, one pass per rollout batch
        learning_rate=args.learning_rate,
        beta=args.beta,
        epsilon=0.2,
        loss_type="grpo",
        scale_rewards="group",
        use_bias_correction_kl=False,
        num_iterations=1,
        adam_beta1=0.9,
        adam_beta2=0.99,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        seed=args.seed,
        # no saving, no eval, no reporting
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        log_completions=False,
    )

    timer = make_timer(torch)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=rewards, args=config, train_dataset=train_dataset,
                          processing_class=tokenizer, callbacks=[timer])
    trainer.remove_callback(PrinterCallback)  # StepTimer prints one short line per step instead

    device = device_name(torch)
    print(f"trl {trl.__version__}, torch {torch.__version__}, device {device}; B={args.num_prompts} "
          f"G={args.num_generations} max_completion_length={args.max_completion_length} dtype={args.dtype} "
          f"micro-batch {micro} x {total // micro} accumulation; {len(rows)} prompts", flush=True)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        trainer.train()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)  # the patched config copy and TRL's (empty) output_dir
    train_s = time.perf_counter() - t0

    steps = [timer.record(k) for k in sorted(timer.end)]
    measured = steps[1:] or steps
    mean_s = statistics.mean(r["wall_s"] for r in measured)
    span = f"steps {measured[0]['step']}-{measured[-1]['step']}" if len(steps) > 1 else "step 1, warm-up included"
    trl_times = [r["trl_step_time_s"] for r in measured if r["trl_step_time_s"] is not None]
    lengths = [r["completion_mean_length"] for r in measured if r["completion_mean_length"] is not None]
    result = {
        "date": dt.date.today().isoformat(),
        "device": device,
        "versions": versions(torch),
        "command": " ".join([Path(sys.argv[0]).as_posix()] + (argv if argv is not None else sys.argv[1:])),
        "workload": {"model": args.model, "dtype": args.dtype, "B": args.num_prompts, "G": args.num_generations,
                     "max_completion_length": args.max_completion_length, "temperature": args.temperature,
                     "micro_batch_size": micro, "gradient_accumulation_steps": total // micro,
                     "learning_rate": args.learning_rate, "beta": args.beta, "prefill": args.prefill,
                     "gradient_checkpointing": args.gradient_checkpointing, "generation": "transformers generate",
                     "rewards": list(BUILTIN_REWARD_NAMES), "data": args.data, "steps": args.steps},
        "s_per_step": mean_s,
        "s_per_step_median": statistics.median(r["wall_s"] for r in measured),
        "measured_steps": span,
        "trl_step_time_s_mean": statistics.mean(trl_times) if trl_times else None,
        "completion_mean_length": statistics.mean(lengths) if lengths else None,
        "completion_tokens_per_s": (statistics.mean(lengths) * total / mean_s) if lengths else None,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 1024 ** 3 if torch.cuda.is_available() else None,
        "train_s": train_s,
        "steps": steps,
    }
    out = Path(args.out)
    if out.suffix != ".json":
        out = out / f"trl_grpo-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(f"JSON: {out}")
    print(f"trl_grpo: {mean_s:.2f} s/step ({span}), trl {trl.__version__}, torch {torch.__version__}, "
          f"device {device}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
