"""The `model` settings (cfg.model; TOML [model]): which model, its compute dtype, and which of its weights
train (full, LoRA/DoRA adapters, a quantized QLoRA base). Read by models/ (loading, adapters, precision)."""

from __future__ import annotations

from dataclasses import dataclass

from mlx_grpo.config.fields import DEFAULT_MODEL, MODEL_CMDS, TUNE, setting


@dataclass(frozen=True)
class ModelConfig:
    """The model to load, its compute dtype, and which of its weights train: all of them, or LoRA/DoRA
    adapters on a frozen (optionally quantized) base."""

    model_name: str = setting(DEFAULT_MODEL, "Model: 'smollm2-135m-instruct' (embedded default, offline), an MLX model "
                              "directory, a checkpoint directory, or a Hugging Face hub id.", MODEL_CMDS)
    model_dtype: str = setting("auto", "Compute dtype of the model's float weights (forward, backward, rollouts): "
                               "auto, float32, bfloat16 or float16. auto = bfloat16 for the embedded default on a GPU "
                               "or Apple Silicon (float32 on a CPU, where MLX's bfloat16 matmuls are ~30x slower), the "
                               "stored dtype for any other model. Training keeps float32 master weights "
                               "(master_weights).", MODEL_CMDS, choices=("auto", "float32", "bfloat16", "float16"))
    train_type: str = setting("full", "full: train every weight; lora: low-rank adapters on the chosen projections (Hu "
                              "et al. 2021); dora: weight-decomposed adapters (Liu et al. 2024). With lora/dora the "
                              "base weights stay frozen and shared by the sampler and the KL reference (the adapters "
                              "switched off), and checkpoints hold only the adapters. Use a ~10x higher learning_rate "
                              "than for full training.", TUNE, choices=("full", "lora", "dora"))
    lora_rank: int = setting(16, "Rank of each adapter (lora/dora).", TUNE, range=">= 1")
    lora_alpha: float = setting(32.0, "Adapter scale numerator: the update is (alpha / rank) * B @ A.", TUNE,
                                range="> 0")
    lora_dropout: float = setting(0.0, "Dropout on the adapters' input in the gradient pass (0 = off). RL trainers "
                                  "usually keep it off: the sampler and old-policy passes run without it, so ratios "
                                  "start away from 1, and its masks depend on the micro-batch split. Not with "
                                  "grad_checkpoint (the recomputed layer would draw another mask).", TUNE,
                                  range="[0, 1)")
    lora_layers: int = setting(0, "Adapt the last N transformer blocks (0 = all).", TUNE,
                               range=">= 0", note="0 = all blocks")
    lora_keys: list[str] = setting([], "Projections to adapt, as named inside a block, e.g. self_attn.q_proj, "
                                   "mlp.down_proj, or a MoE's experts, e.g. mlp.switch_mlp.gate_proj (empty = every "
                                   "linear and expert projection of the block; dora cannot adapt experts).", TUNE)
    load_in_bits: int = setting(0, "QLoRA (Dettmers et al. 2023): quantize the frozen base to 4 or 8 bits (group 64) "
                                "at load time, adapters on top in float; 0 = keep the base as loaded. A model already "
                                "quantized on disk trains with lora/dora as it is.", TUNE, choices=(0, 4, 8))
