"""The optimization of an update, from the weighted loss to new weights (sft/steps.py takes the same step):

- the gradient pass: each row's weight in the loss (loss.row_scales over every rank's rows), the value_and_grad
  of one micro-batch's weighted loss sums (compiled with use_compile), their sum over every micro-batch of every
  batch step in float32, and clipping by the global norm;
- the step: AdamW built from the config and its learning-rate schedule, applied on the float32 master weights
  (MasterWeights) when the model computes in a narrower dtype."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from mlx_grpo.config import Config
from mlx_grpo.loss import LossSums, Objective, combine_sums, objective_sums, row_scales
from mlx_grpo.models.forward import PackedBatch, completion_logprobs
from mlx_grpo.rollout.rollout_records import Rollout, chunk_batch, row_chunks
from mlx_grpo.training.distributed import World
from mlx_grpo.training.records import StepData


# ------------------------------------------------------------------ the gradient pass
def make_grad_fn(cfg: Config, model: nn.Module):
    """value_and_grad of one micro-batch's weighted loss sum (aux: the other LossSums fields); compiled
    when use_compile is set."""
    objective = Objective.from_config(cfg)

    def loss_fn(_model, batch_arrays, old, ref, adv, weights, sampler, sampled, teacher, topk):
        packed, student_topk = PackedBatch(*batch_arrays), None
        if topk is None:
            lp = completion_logprobs(model, packed, cfg.rollout.temperature,
                                     checkpoint_layers=cfg.training.grad_checkpoint)
        else:  # distill_topk: the student's log-probs at the teacher's top-k ids, from the same head pass
            lp, student_topk = completion_logprobs(model, packed, cfg.rollout.temperature,
                                                   checkpoint_layers=cfg.training.grad_checkpoint, extra=topk[0])
        # on-policy the old policy is the model itself: its log-probs, teacher-forced on a demonstration too
        old_lp = mx.stop_gradient(lp) if old is None else old
        sums = objective_sums(lp, old_lp, ref, adv, batch_arrays[3], weights, objective, sampler, sampled, teacher,
                              None if topk is None else (student_topk, topk[1]))
        return sums.loss, tuple(sums[1:])

    grad_fn = nn.value_and_grad(model, loss_fn)

    def step(batch_arrays, old, ref, adv, weights, sampler, sampled=None, teacher=None, topk=None):
        """topk: distill_topk's (teacher top-k ids [n, T, k], teacher log-probs [n, T, k]), or None."""
        return grad_fn(model, batch_arrays, old, ref, adv, weights, sampler, sampled, teacher, topk)

    if cfg.training.use_compile:
        # nn.value_and_grad swaps traced arrays into the model while tracing: declare the state as output
        # too, or the model keeps placeholder arrays after the compiled call. Adapter dropout draws from
        # the global random state, which must then be threaded through as well.
        state = [model.state, mx.random.state] if cfg.model.lora_dropout > 0 else model.state
        return mx.compile(step, inputs=state, outputs=state)
    return step


def kept_rows(cfg: Config, rollout: Rollout) -> np.ndarray:
    """[N] bool: rows that enter the loss; completions cut by max_new_tokens are dropped with
    mask_truncated_completions."""
    return ~rollout.truncated if cfg.objective.mask_truncated_completions else np.ones(len(rollout.texts), bool)


def loss_weights(cfg: Config, steps: list[StepData], world: World | None = None) -> list[mx.array]:
    """Each of this rank's rows' weight in the update's loss, per batch step: loss.row_scales over the rows
    of every rank of `world` (default: this process alone), times the number of ranks, so the mean of
    the ranks' gradients is the whole batch's."""
    world = world or World()
    mine = [(s.rollout.lengths, kept_rows(cfg, s.rollout)) for s in steps]
    ranks = world.gather(mine, "the loss weights")  # [W][steps] (lengths [n], keep [n])
    scales = row_scales([np.concatenate([r[i][0] for r in ranks]) for i in range(len(steps))],
                        [np.concatenate([r[i][1] for r in ranks]) for i in range(len(steps))],
                        cfg.objective.loss_type, cfg.rollout.max_new_tokens)
    weights = []
    for i, w in enumerate(scales):
        start = sum(len(r[i][0]) for r in ranks[:world.rank])
        weights.append(mx.array(w[start:start + len(mine[i][0])] * world.size))
    return weights


def accumulate_gradients(step_fn, steps: list[StepData], weights: list[mx.array], micro_batch: int, pad_id: int,
                         max_tokens: int = 0):
    """Sum gradients of every micro-batch of every step; weights[s] [N_s] (loss.row_scales) make the total
    the update's loss. Rows of weight 0 never enter a pass. Gradients are summed in float32 whatever the
    compute dtype (they feed float32 master weights). -> (grads or None, LossSums totals)."""
    grads, totals = None, None
    for s, w in zip(steps, weights):
        rows = [r for r, v in enumerate(w.tolist()) if v > 0]
        for chunk in (row_chunks(s.rollout, micro_batch, max_tokens, rows) if rows else []):
            batch, width = chunk_batch(s.rollout, chunk, pad_id)
            old = None if s.old_logprobs is None else s.old_logprobs[chunk, :width]
            ref = None if s.ref_logprobs is None else s.ref_logprobs[chunk, :width]
            teacher = None if s.teacher_logprobs is None else s.teacher_logprobs[chunk, :width]
            top = s.teacher_topk
            topk = None if top is None else (top.ids[chunk, :width], top.logprobs[chunk, :width])
            sampler = s.rollout.sampler_logprobs[chunk, :width]
            # demonstrations (rollout.demo) are no sampler's draws: 0 leaves them out of the rollout correction
            sampled = None if s.rollout.demo is None else mx.array(~s.rollout.demo, dtype=mx.float32)[chunk]
            arrays = (batch.inputs, batch.positions, batch.targets, batch.mask)
            (loss, aux), g = step_fn(arrays, old, ref, s.advantages[chunk], w[chunk], sampler, sampled, teacher, topk)
            sums = LossSums(loss, *aux)
            g = tree_map(lambda x: x.astype(mx.float32), g)
            if grads is None:
                grads, totals = g, sums
            else:
                grads = tree_map(mx.add, grads, g)
                totals = combine_sums(totals, sums)
            mx.eval(grads, totals)  # one boundary per micro-batch bounds memory
    return grads, totals


def clip_by_global_norm(grads, max_norm: float):
    """-> (grads, global norm before clipping); max_norm 0 means no clipping."""
    norm = mx.sqrt(sum(mx.sum(g.astype(mx.float32) ** 2) for _, g in tree_flatten(grads)))
    if max_norm <= 0:
        return grads, norm
    factor = mx.minimum(1.0, max_norm / (norm + 1e-6))
    return tree_map(lambda g: (g * factor).astype(g.dtype), grads), norm


# ------------------------------------------------------------------ the step
class MasterWeights:
    """Float32 masters of a model's trainable tensors, taken from them as they are now (before the model
    is cast to its compute dtype); disabled when the model trains in float32 or master_weights is off:
    optimizer_step then updates the model directly, as plain AdamW does."""

    def __init__(self, model: nn.Module, enabled: bool):
        trainable = dict(tree_flatten(model.trainable_parameters()))
        self.masters = {k: p.astype(mx.float32) for k, p in trainable.items()} if enabled else None

    @property
    def active(self) -> bool:
        return self.masters is not None

    def adopt(self, masters: dict[str, mx.array] | None) -> None:
        """Take the masters (flat, e.g. from a checkpoint) before the compute copy is cast from them."""
        if self.masters is not None and masters is not None:
            self.masters = {k: masters[k].astype(mx.float32) for k in self.masters}

    def sync(self, model: nn.Module) -> None:
        """Refresh the model's trained tensors from the masters, each in its own compute dtype."""
        if self.masters is None:
            return
        current = dict(tree_flatten(model.trainable_parameters()))
        model.update(tree_unflatten([(k, m.astype(current[k].dtype)) for k, m in self.masters.items()]))

    def arrays(self) -> list[mx.array]:
        return list(self.masters.values()) if self.masters is not None else []


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
