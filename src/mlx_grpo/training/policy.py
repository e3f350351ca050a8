"""The three policies of GRPO and the passes over them.

`model` is trained; the old (behaviour) policy samples and gives old log-probs; the reference policy
(frozen initial weights) anchors the KL term. With lora/dora adapters the reference is `model` itself
with the adapters switched off, so no second copy of the weights exists. With update_every = 1,
num_iterations = 1 and no rollout quantization, the old policy *is* `model` and no copy exists.
Log-prob and gradient passes run in length-sorted micro-batches so full [N, L, V] logits never exist.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map

from mlx_grpo.config import Config
from mlx_grpo.distributed import World
from mlx_grpo.loss import LossSums, Objective, combine_sums, objective_sums, row_scales
from mlx_grpo.models.adapters import adapters_disabled
from mlx_grpo.models.forward import PackedBatch, bucket, completion_logprobs, pack, packed_width
from mlx_grpo.rollout.records import Rollout

ROLLOUT_QUANT_BITS = 4
ROLLOUT_QUANT_GROUP = 64


@dataclass
class StepData:
    """One batch step's rollout with everything the loss needs."""

    rollout: Rollout
    advantages: mx.array | None  # [N]; None while `pending`
    old_logprobs: mx.array | None  # [N, T]; None: the sampler is the current model (ratio 1 at start)
    ref_logprobs: mx.array | None  # [N, T]; None when kl_coeff = 0
    pending: object = None  # trainer.PendingRewards while the rewards are still being computed; then None


class Policies:
    """Owns `model`, the old (sampling) policy and the frozen reference."""

    def __init__(self, cfg: Config, model: nn.Module, reference: nn.Module | None, adapters: bool = False):
        self.cfg = cfg
        self.model = model
        self.reference = reference
        self.adapters = adapters  # lora/dora: the reference is `model` with its adapters switched off
        if reference is not None:
            reference.freeze()
        # A separate old policy exists only when it can differ from `model` while sampling.
        self.separate_old = cfg.update_every > 1 or cfg.quantize_for_rollouts
        self.old_params = None
        self.sampler: nn.Module = model
        if self.separate_old:
            self.refresh()

    def refresh(self, old_params: dict | None = None) -> None:
        """Point the old policy at the current weights (arrays are shared, not copied: the optimizer
        replaces `model`'s arrays, so the old ones stay as they were). Re-quantize if asked."""
        self.old_params = old_params if old_params is not None else self.model.parameters()
        sampler = copy.deepcopy(self.model)
        sampler.update(self.old_params)
        if self.cfg.quantize_for_rollouts:
            # Layers whose input width is not a multiple of the group size stay in float.
            nn.quantize(sampler, group_size=ROLLOUT_QUANT_GROUP, bits=ROLLOUT_QUANT_BITS,
                        class_predicate=lambda _, m: hasattr(m, "to_quantized")
                        and m.weight.shape[-1] % ROLLOUT_QUANT_GROUP == 0)
        sampler.freeze()
        self.sampler = sampler

    def reference_logprobs(self, rollout: Rollout, pad_id: int) -> mx.array | None:
        """Log-probs [N, T] under the frozen reference, or None without a KL term."""
        cfg = self.cfg
        if cfg.kl_coeff == 0:
            return None
        if self.adapters:
            with adapters_disabled(self.model):
                return logprob_pass(self.model, rollout, cfg.temperature, cfg.micro_batch_size, pad_id,
                                    cfg.micro_batch_tokens)
        return logprob_pass(self.reference, rollout, cfg.temperature, cfg.micro_batch_size, pad_id,
                            cfg.micro_batch_tokens)

    @property
    def needs_old_pass(self) -> bool:
        """Old log-probs must be computed (not taken as stop_gradient of the current ones)."""
        return self.separate_old or self.cfg.num_iterations > 1


def _completion_width(rollout: Rollout, longest: int) -> int:
    """Completion columns of a micro-batch whose longest completion has `longest` tokens: bucketed
    (fewer distinct shapes), never past the rollout's own width."""
    return min(bucket(max(longest, 1)), rollout.completion_ids.shape[1])


def row_chunks(rollout: Rollout, size: int, max_tokens: int = 0, rows: list[int] | None = None) -> list[mx.array]:
    """Row indices (of `rows`, default all) in micro-batches of at most `size` rows and (if max_tokens) at
    most max_tokens padded tokens, counted exactly as _chunk_batch/pack() lay them out (bucketed widths);
    longest completions first, so an out-of-memory shows at once. A single row is never split."""
    completion = [int(n) for n in rollout.extents]  # fed context inside a multi-turn completion included
    prompt = [len(p) for p in rollout.row_prompts]
    order = sorted(range(len(completion)) if rows is None else rows, key=lambda r: -completion[r])
    chunks, current, widest_prompt = [], [], 0
    for r in order:
        longest = completion[current[0]] if current else completion[r]  # rows come longest first
        width = packed_width(max(widest_prompt, prompt[r]), _completion_width(rollout, longest))
        padded = (len(current) + 1) * width
        if current and (len(current) == size or (max_tokens and padded > max_tokens)):
            chunks.append(current)
            current, widest_prompt = [], 0
        current.append(r)
        widest_prompt = max(widest_prompt, prompt[r])
    if current:
        chunks.append(current)
    return [mx.array(c) for c in chunks]


def _chunk_batch(rollout: Rollout, rows: mx.array, pad_id: int):
    width = _completion_width(rollout, max(int(rollout.extents[r]) for r in rows.tolist()))
    prompts = rollout.row_prompts
    return pack([prompts[r] for r in rows.tolist()], rollout.completion_ids[rows, :width],
                rollout.mask[rows, :width], pad_id), width


def logprob_pass(model: nn.Module, rollout: Rollout, temperature: float, micro_batch: int,
                 pad_id: int, max_tokens: int = 0) -> mx.array:
    """Log-probs [N, T] of the sampled tokens under `model`, without gradients."""
    N, T = rollout.completion_ids.shape
    out = mx.zeros((N, T), dtype=mx.float32)
    for rows in row_chunks(rollout, micro_batch, max_tokens):
        batch, width = _chunk_batch(rollout, rows, pad_id)
        lp = mx.stop_gradient(completion_logprobs(model, batch, temperature)) * batch.mask
        out[rows, :width] = lp
        mx.eval(out)
    return out


def make_grad_fn(cfg: Config, model: nn.Module):
    """value_and_grad of one micro-batch's weighted loss sum (aux: the other LossSums fields); compiled
    when use_compile is set."""
    objective = Objective.from_config(cfg)

    def loss_fn(_model, batch_arrays, old, ref, adv, weights, sampler, sampled):
        lp = completion_logprobs(model, PackedBatch(*batch_arrays), cfg.temperature,
                                 checkpoint_layers=cfg.grad_checkpoint)
        # on-policy the old policy is the model itself: its log-probs, teacher-forced on a demonstration too
        old_lp = mx.stop_gradient(lp) if old is None else old
        sums = objective_sums(lp, old_lp, ref, adv, batch_arrays[3], weights, objective, sampler, sampled)
        return sums.loss, tuple(sums[1:])

    grad_fn = nn.value_and_grad(model, loss_fn)

    def step(batch_arrays, old, ref, adv, weights, sampler, sampled=None):
        return grad_fn(model, batch_arrays, old, ref, adv, weights, sampler, sampled)

    if cfg.use_compile:
        # nn.value_and_grad swaps traced arrays into the model while tracing: declare the state as output
        # too, or the model keeps placeholder arrays after the compiled call. Adapter dropout draws from
        # the global random state, which must then be threaded through as well.
        state = [model.state, mx.random.state] if cfg.lora_dropout > 0 else model.state
        return mx.compile(step, inputs=state, outputs=state)
    return step


def kept_rows(cfg: Config, rollout: Rollout) -> np.ndarray:
    """[N] bool: rows that enter the loss; completions cut by max_new_tokens are dropped with
    mask_truncated_completions."""
    return ~rollout.truncated if cfg.mask_truncated_completions else np.ones(len(rollout.texts), bool)


def loss_weights(cfg: Config, steps: list[StepData], world: World | None = None) -> list[mx.array]:
    """Each of this rank's rows' weight in the update's loss, per batch step: loss.row_scales over the rows
    of every rank of `world` (default: this process alone), times the number of ranks, so the mean of
    the ranks' gradients is the whole batch's."""
    world = world or World()
    mine = [(s.rollout.lengths, kept_rows(cfg, s.rollout)) for s in steps]
    ranks = world.gather(mine, "the loss weights")  # [W][steps] (lengths [n], keep [n])
    scales = row_scales([np.concatenate([r[i][0] for r in ranks]) for i in range(len(steps))],
                        [np.concatenate([r[i][1] for r in ranks]) for i in range(len(steps))],
                        cfg.loss_type, cfg.max_new_tokens)
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
            batch, width = _chunk_batch(s.rollout, chunk, pad_id)
            old = None if s.old_logprobs is None else s.old_logprobs[chunk, :width]
            ref = None if s.ref_logprobs is None else s.ref_logprobs[chunk, :width]
            sampler = s.rollout.sampler_logprobs[chunk, :width]
            # demonstrations (rollout.demo) are no sampler's draws: 0 leaves them out of the rollout correction
            sampled = None if s.rollout.demo is None else mx.array(~s.rollout.demo, dtype=mx.float32)[chunk]
            arrays = (batch.inputs, batch.positions, batch.targets, batch.mask)
            (loss, aux), g = step_fn(arrays, old, ref, s.advantages[chunk], w[chunk], sampler, sampled)
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

