"""The optimizer of an update: AdamW built from the config, the learning-rate schedule, and the step that
applies clipped gradients, on the float32 master weights when the model computes in a narrower dtype
(models/precision.py keeps the masters; the step that moves them is here). sft/steps.py takes the same step."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from mlx_grpo.config import Config
from mlx_grpo.models.precision import MasterWeights


def make_optimizer(cfg: Config, learning_rate: float) -> optim.AdamW:
    return optim.AdamW(learning_rate=learning_rate, betas=[cfg.optimizer.adam_beta1, cfg.optimizer.adam_beta2],
                       weight_decay=cfg.optimizer.weight_decay, bias_correction=True)


def learning_rate_at(update: int, total: int, cfg: Config) -> float:
    """Linear warmup then cosine/linear/constant decay towards 0. update is 1-based; the decay
    starts from the peak at the first update after warmup, so no update has a zero rate."""
    warmup = int(math.ceil(cfg.optimizer.warmup_ratio * total))
    if update <= warmup:
        return cfg.optimizer.learning_rate * update / warmup
    if cfg.optimizer.lr_scheduler_type == "constant" or total <= warmup:
        return cfg.optimizer.learning_rate
    progress = (update - warmup - 1) / (total - warmup)
    if cfg.optimizer.lr_scheduler_type == "linear":
        return cfg.optimizer.learning_rate * max(0.0, 1.0 - progress)
    return cfg.optimizer.learning_rate * 0.5 * (1.0 + math.cos(math.pi * progress))


def optimizer_step(optimizer, model: nn.Module, grads, masters: MasterWeights) -> None:
    """One optimizer step: on the float32 masters (then the model's compute copy follows), or, without
    masters, on the model directly as plain AdamW does; evaluated, so the step's buffers can be freed."""
    if masters.active:
        flat = {k: g.astype(mx.float32) for k, g in tree_flatten(grads)}
        new = optimizer.apply_gradients(tree_unflatten(list(flat.items())),
                                        tree_unflatten(list(masters.masters.items())))
        masters.adopt(dict(tree_flatten(new)))
        masters.sync(model)
    else:
        current = dict(tree_flatten(model.trainable_parameters()))
        optimizer.update(model, tree_unflatten([(k, g.astype(current[k].dtype)) for k, g in tree_flatten(grads)]))
    mx.eval(model.parameters(), optimizer.state, masters.arrays())
