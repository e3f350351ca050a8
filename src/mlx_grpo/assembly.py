"""Assembling a Trainer from a Config (run.py and the benches call `build_trainer`): the training and
evaluation examples, the reward set, the model loaded and cast to its compute dtype with its float32
masters, LoRA/DoRA adapters and the QLoRA base, the KL reference model, the start-up memory check for the
rollouts (and the rollout engine's copy), and the warnings about settings that will not do what they say
(check_prompt_lengths: prompts that max_prompt_length cuts, measured before the first update).
trainer.py holds the GRPO steps and checkpoint state; it never imports this module.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_grpo.config import Config
from mlx_grpo.data import load_examples, subset
from mlx_grpo.distributed import World
from mlx_grpo.engine import uses_copy
from mlx_grpo.errors import UserError
from mlx_grpo.health import prompt_cut_report
from mlx_grpo.models import decoder
from mlx_grpo.models.adapters import ADAPTER_LAYERS, apply_adapters, quantize_base
from mlx_grpo.models.forward import supports_layer_checkpointing
from mlx_grpo.models.loading import load_model, resolve_model_path
from mlx_grpo.multiturn import encode_prompts
from mlx_grpo.models.precision import MasterWeights, cast_floats, check_rounding, compute_dtype, dtype_name
from mlx_grpo.policy import Policies
from mlx_grpo.reward_workers import build_reward_set
from mlx_grpo.rollout import machine_memory_bytes, rollout_memory_bytes
from mlx_grpo.trainer import Trainer


def build_trainer(cfg: Config, world: World | None = None) -> Trainer:
    """Load data, rewards and the models for a run (no side effects on disk); world: this process's place
    in a data-parallel run (default: alone)."""
    train = load_examples(cfg.dataset, "train", cfg.dataset_path or None, cfg.seed, arith_max_steps=cfg.arith_max_steps)
    if cfg.max_train_samples:
        train = subset(train, cfg.max_train_samples, cfg.seed)
    rewards = build_reward_set(cfg, Path.cwd())
    source_dir = Path(resolve_model_path(cfg.model_name))
    if not source_dir.is_dir():  # a hub id: mlx-lm downloads it; find its local snapshot
        from mlx_lm.utils import hf_repo_to_path

        source_dir = Path(hf_repo_to_path(cfg.model_name))
    model, tokenizer = load_model(cfg.model_name, cfg.model_dtype, cast=False)
    dtype = compute_dtype(cfg.model_name, cfg.model_dtype, model)
    mixed = cfg.master_weights and dtype != mx.float32  # float32 masters of the trained weights
    if any(isinstance(m, ADAPTER_LAYERS) for _, m in model.named_modules()):
        raise UserError(f"model {cfg.model_name!r} carries lora/dora adapters: continue its run with --resume, "
                        "or merge them first with `mlx-grpo fuse`")
    quantized = any(k.endswith(".scales") for k, _ in tree_flatten(model.parameters()))
    adapter_config = None
    if cfg.train_type == "full":
        if quantized:
            raise UserError(f"model {cfg.model_name!r} is quantized; full fine-tuning needs float weights: convert "
                            "it without --quantize, or train adapters on it (train_type = lora: QLoRA)")
        masters = MasterWeights(model, mixed)  # from the weights as stored, before they are cast
        cast_floats(model, dtype)
        reference = load_model(cfg.model_name, cfg.model_dtype)[0] if cfg.kl_coeff > 0 else None
    else:
        cast_floats(model, dtype)  # the frozen base computes in the compute dtype; adapters get masters
        if cfg.load_in_bits:
            quantize_base(model, cfg.load_in_bits)
        elif quantized and cfg.quantize_for_rollouts:
            raise UserError(f"model {cfg.model_name!r} is already quantized: quantize_for_rollouts has nothing to "
                            "do; drop it")
        mx.random.seed(cfg.seed)  # the adapters' initial weights come from the global generator
        adapter_config = apply_adapters(model, cfg.train_type, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout,
                                        cfg.lora_layers, cfg.lora_keys)
        adapter_config["mlx_grpo"] = {"base_model": cfg.model_name, "base_dir": str(source_dir.resolve()),
                                      "load_in_bits": cfg.load_in_bits, "model_dtype": dtype_name(dtype)}
        masters = MasterWeights(model, mixed)  # mlx-lm creates the adapters in float32
        cast_floats(model, dtype)
        reference = None  # the KL reference is `model` with its adapters switched off
    rows = cfg.batch_size // (world.size if world else 1) * cfg.num_generations
    need, have = rollout_memory_bytes(model, rows, cfg.max_prompt_length + cfg.max_new_tokens), machine_memory_bytes()
    copy = decoder.copy_bytes(model, dtype) if need and uses_copy(cfg.rollout_engine, model) else 0
    if need and have and need + copy > have:  # found up front, not by the OOM killer a minute in
        raise UserError(f"{rows} rollout rows (batch_size {cfg.batch_size} x num_generations {cfg.num_generations}"
                        f"{' per rank' if world and world.size > 1 else ''}) of up to "
                        f"{cfg.max_prompt_length + cfg.max_new_tokens} tokens need at least {need / 1e9:.1f} GB for "
                        f"their KV cache and logits" + (f", plus {copy / 1e9:.1f} GB for the rollout engine's copy "
                                                       "of the weights" if copy else "")
                        + f", more than this machine's {have / 1e9:.1f} GB: lower num_generations, batch_size or "
                        "max_new_tokens" + (", or set rollout_engine = model" if copy else ""))
    if cfg.grad_checkpoint and not supports_layer_checkpointing(model):
        print(f"[mlx-grpo] warning: grad_checkpoint has no effect for model type "
              f"{getattr(model, 'model_type', '?')!r}: its layers are not recomputed, memory stays as without it",
              flush=True)
    if not masters.active:
        warning = check_rounding(dict(tree_flatten(model.trainable_parameters())), cfg.learning_rate, dtype,
                                 "set master_weights = true (float32 masters) or model_dtype = float32")
        if warning and (world is None or world.is_main):
            print(f"[mlx-grpo] warning: {warning}", flush=True)
    policies = Policies(cfg, model, reference, adapters=adapter_config is not None)
    evals = None
    if cfg.eval_every_updates or cfg.eval_steps:
        evals = load_examples(cfg.dataset, "test", cfg.eval_dataset_path or None, cfg.seed,
                              arith_max_steps=cfg.arith_max_steps)
    return Trainer(cfg, model, tokenizer, policies, rewards, train, Path(cfg.output_dir) / cfg.run_name,
                   source_dir, evals, adapter_config, masters, world or World())


def check_prompt_lengths(trainer: Trainer, measured: int = 2000) -> None:
    """Say at start how much max_prompt_length cuts the training prompts (a seeded sample of them), and
    refuse a length that would cut the question out of most of them."""
    cfg = trainer.cfg
    whole = dataclasses.replace(cfg, max_prompt_length=sys.maxsize)  # each prompt's length uncut
    examples = subset(trainer.train_examples, measured, cfg.seed)
    lengths = [len(ids) for ids, _ in encode_prompts(trainer.multiturn, trainer.tokenizer, examples, whole)]
    warning, error = prompt_cut_report(lengths, cfg.max_prompt_length)
    if error:
        trainer.world.fail(error)
    if warning:
        trainer.world.print(f"[mlx-grpo] warning: {warning}")
