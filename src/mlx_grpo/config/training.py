"""The `optimizer` settings (cfg.optimizer; TOML [optimizer]): AdamW, its schedule, gradient clipping and
master weights; and the `training` settings (cfg.training; TOML [training]): how the data becomes updates
(epochs, batch, accumulation) and how each gradient pass runs (micro-batches, checkpointing, compile)."""

from __future__ import annotations

from dataclasses import dataclass

from mlx_grpo.config.fields import TRAIN, TUNE, setting


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer step: AdamW, its learning-rate schedule, gradient clipping, float32 master weights."""

    # Supervised steps follow one fixed target, not sampled rewards: a larger step is safe.
    learning_rate: float = setting(1e-6, "Peak AdamW learning rate.", TUNE, range="> 0", per_command={"sft": 1e-5})
    lr_scheduler_type: str = setting("cosine", "Learning-rate schedule after warmup: cosine, linear or constant.", TUNE,
                                     choices=("cosine", "linear", "constant"))
    warmup_ratio: float = setting(0.1, "Fraction of the run's updates spent in linear warmup.", TUNE, range="[0, 1)")
    adam_beta1: float = setting(0.9, "AdamW beta1.", TUNE, range="[0, 1)")
    adam_beta2: float = setting(0.99, "AdamW beta2.", TUNE, range="[0, 1)")
    weight_decay: float = setting(0.0, "AdamW decoupled weight decay.", TUNE, range=">= 0")
    max_grad_norm: float = setting(1.0, "Clip the global gradient norm to this (0 = no clipping).", TUNE, range=">= 0")
    master_weights: bool = setting(True, "Mixed precision: keep a float32 master copy of the trained weights (and "
                                   "AdamW's state in float32) when model_dtype is bfloat16/float16; AdamW updates the "
                                   "masters and the compute weights are refreshed from them after every update. "
                                   "Without it, steps below half a bfloat16 spacing (most steps at learning rates "
                                   "~1e-6..1e-5) round away: such a run is refused, naming the share lost. Costs 4 "
                                   "bytes per trained weight (plus AdamW's 8 in float32 instead of 4).", TUNE)


@dataclass(frozen=True)
class TrainingConfig:
    """Batches and accumulation, and how each gradient pass runs (micro-batches, recomputed layers,
    mx.compile): the memory/time trade-offs."""

    num_epochs: int = setting(1, "Passes over the training data.", TUNE, range=">= 1")
    batch_size: int = setting(4, "Prompts per batch step (B), across all ranks of a data-parallel run (each takes "
                              "batch_size / ranks of them). sft: examples per batch step.", TUNE, range=">= 1")
    gradient_accumulation_steps: int = setting(1, "Batch steps per optimizer update.", TUNE, range=">= 1")
    micro_batch_size: int = setting(16, "Sequences per forward/backward chunk in log-prob and training passes; bounds "
                                    "memory, does not change results.", TUNE, range=">= 1", resume_may_change=True)
    micro_batch_tokens: int = setting(8192, "Most padded prompt+completion tokens per forward/backward chunk (0 = no "
                                      "limit): bounds memory whatever the batch size; does not change results.", TUNE,
                                      range=">= 0", resume_may_change=True)
    grad_checkpoint: bool = setting(False, "Recompute each transformer layer in the backward pass instead of keeping "
                                    "its activations: training memory drops to about the layers' inputs, for ~1/3 more "
                                    "compute. Same results.", TUNE, resume_may_change=True)
    use_compile: bool = setting(False, "Compile the loss/gradient step with mx.compile.", TRAIN)
    train_vision: bool = setting(False, "With image_column: train the vision tower too (full: its weights; lora/dora: "
                                 "adapters on the language model plus the whole tower). Off: the tower stays frozen "
                                 "and each prompt's images are encoded once per rollout.", TRAIN)
    compile_update: bool = setting(False, "Run each optimizer step (AdamW on the float32 masters, or on the model, and "
                                   "the compute copy cast from them) as one compiled function "
                                   "(training/compiled_update.py): one fused kernel per tensor instead of ~15 "
                                   "launches. Weights equal the eager step's within float32 rounding (tests).", TRAIN)
