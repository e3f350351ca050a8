"""The three policies of GRPO and the log-prob passes over them (optimization.py holds the gradient pass).

`model` is trained; the old (behaviour) policy samples and gives old log-probs; the reference policy
(frozen initial weights) anchors the KL term. With lora/dora adapters the reference is `model` itself
with the adapters switched off, so no second copy of the weights exists. With update_every = 1,
num_iterations = 1 and no rollout quantization, the old policy *is* `model` and no copy exists.
Log-prob and gradient passes run in length-sorted micro-batches so full [N, L, V] logits never exist.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn

from mlx_grpo.config import Config
from mlx_grpo.models.adapters import adapters_disabled
from mlx_grpo.models.forward import completion_logprobs, completion_topk
from mlx_grpo.rollout.engine import RolloutEngine
from mlx_grpo.rollout.rollout_records import Rollout, chunk_batch, row_chunks
from mlx_grpo.training.records import TeacherTopK
from mlx_grpo.training.served_teacher import ServedTeacher

ROLLOUT_QUANT_BITS = 4
ROLLOUT_QUANT_GROUP = 64


class Policies:
    """Owns `model`, the old (sampling) policy, the frozen reference, and the rollout engine: the sampling
    policy as the decode runs it (rollout/engine.py; its own copy of the weights unless it decodes the model),
    rebuilt whenever that policy changes."""

    def __init__(self, cfg: Config, model: nn.Module, reference: nn.Module | None, engine: RolloutEngine,
                 adapters: bool = False, teacher: nn.Module | ServedTeacher | None = None,
                 teacher_source: str | None = None, tokens: int | None = None):
        self.cfg = cfg
        self.tokens = tokens  # the tokenizer's vocabulary: distill_topk's teacher ids stay below it
        # on-policy distillation: scores the sampled tokens, never trained; a model here, or teacher_url's server
        self.teacher = teacher
        self.teacher_source = teacher_source  # the checkpoint or URL it came from: a resume must keep it
        if isinstance(teacher, nn.Module):
            teacher.freeze()
        self.model = model
        self.reference = reference
        self.adapters = adapters  # lora/dora: the reference is `model` with its adapters switched off
        if reference is not None:
            reference.freeze()
        # A separate old policy exists only when it can differ from `model` while sampling.
        self.separate_old = cfg.objective.update_every > 1 or cfg.rollout.quantize_for_rollouts
        self.old_params = None
        self.sampler: nn.Module = model
        if self.separate_old:
            self.refresh()
        self.engine = engine.refresh(self.sampler)

    def refresh(self, old_params: dict | None = None) -> None:
        """Point the old policy at the current weights (arrays are shared, not copied: the optimizer
        replaces `model`'s arrays, so the old ones stay as they were). Re-quantize if asked."""
        self.old_params = old_params if old_params is not None else self.model.parameters()
        sampler = copy.deepcopy(self.model)
        sampler.update(self.old_params)
        if self.cfg.rollout.quantize_for_rollouts:
            # Layers whose input width is not a multiple of the group size stay in float.
            nn.quantize(sampler, group_size=ROLLOUT_QUANT_GROUP, bits=ROLLOUT_QUANT_BITS,
                        class_predicate=lambda _, m: hasattr(m, "to_quantized")
                        and m.weight.shape[-1] % ROLLOUT_QUANT_GROUP == 0)
        sampler.freeze()
        self.sampler = sampler

    def after_update(self, update_step: int, applied: bool) -> None:
        """Point the old policy at the new weights every update_every updates, and the engine at the
        sampling policy whenever its weights changed."""
        refresh_old = self.separate_old and update_step % self.cfg.objective.update_every == 0
        if refresh_old:
            self.refresh()
        if refresh_old or (applied and not self.separate_old):
            self.engine.refresh(self.sampler)

    def logprobs(self, model: nn.Module, rollout: Rollout, pad_id: int) -> mx.array:
        """logprob_pass under `model` at the run's sampling temperature and micro-batch limits."""
        t = self.cfg.training
        return logprob_pass(model, rollout, self.cfg.rollout.temperature, t.micro_batch_size, pad_id,
                            t.micro_batch_tokens)

    def reference_logprobs(self, rollout: Rollout, pad_id: int) -> mx.array | None:
        """Log-probs [N, T] under the frozen reference, or None without a KL term."""
        if self.cfg.objective.kl_coeff == 0:
            return None
        if self.adapters:
            with adapters_disabled(self.model):
                return self.logprobs(self.model, rollout, pad_id)
        return self.logprobs(self.reference, rollout, pad_id)

    def teacher_logprobs(self, rollout: Rollout, pad_id: int) -> mx.array | None:
        """Log-probs [N, T] of the sampled tokens under the teacher (micro-batched like the reference's, at
        the sampling temperature: the distribution the student's tokens were drawn from), or None. A served
        teacher scores each row on its server (temperature 1 only: validation.py)."""
        if self.teacher is None:
            return None
        if isinstance(self.teacher, ServedTeacher):
            return self.teacher.logprobs(rollout)
        return self.logprobs(self.teacher, rollout, pad_id)

    def teacher_scores(self, rollout: Rollout, pad_id: int) -> tuple[mx.array | None, TeacherTopK | None]:
        """teacher_logprobs and, with distill_topk > 0, the teacher's top-k at each position, both from one pass
        over the teacher (a served one: one request per row)."""
        k = self.cfg.objective.distill_topk
        if self.teacher is None or k == 0:
            return self.teacher_logprobs(rollout, pad_id), None
        if isinstance(self.teacher, ServedTeacher):
            lp, ids, top = self.teacher.scores(rollout, k, self.tokens)
            return lp, TeacherTopK(ids, top)
        t = self.cfg.training
        return topk_pass(self.teacher, rollout, self.cfg.rollout.temperature, t.micro_batch_size, pad_id, k,
                         t.micro_batch_tokens, self.tokens)

    @property
    def needs_old_pass(self) -> bool:
        """Old log-probs must be computed (not taken as stop_gradient of the current ones)."""
        return self.separate_old or self.cfg.objective.num_iterations > 1


def logprob_pass(model: nn.Module, rollout: Rollout, temperature: float, micro_batch: int,
                 pad_id: int, max_tokens: int = 0) -> mx.array:
    """Log-probs [N, T] of the sampled tokens under `model`, without gradients."""
    N, T = rollout.completion_ids.shape
    out = mx.zeros((N, T), dtype=mx.float32)
    for rows in row_chunks(rollout, micro_batch, max_tokens):
        batch, width = chunk_batch(rollout, rows, pad_id)
        lp = mx.stop_gradient(completion_logprobs(model, batch, temperature)) * batch.mask
        out[rows, :width] = lp
        mx.eval(out)
    return out


def topk_pass(model: nn.Module, rollout: Rollout, temperature: float, micro_batch: int, pad_id: int, k: int,
              max_tokens: int = 0, tokens: int | None = None) -> tuple[mx.array, TeacherTopK]:
    """logprob_pass's log-probs [N, T] and, at each completion position, the k most likely tokens under `model`
    (distill_topk's teacher), micro-batched as logprob_pass; 0 (ids and log-probs) where the mask is 0."""
    N, T = rollout.completion_ids.shape
    out = mx.zeros((N, T), dtype=mx.float32)
    top, ids = mx.zeros((N, T, k), dtype=mx.float32), mx.zeros((N, T, k), dtype=mx.int32)
    for rows in row_chunks(rollout, micro_batch, max_tokens):
        batch, width = chunk_batch(rollout, rows, pad_id)
        lp, top_lp, top_ids = completion_topk(model, batch, temperature, k, tokens=tokens)
        out[rows, :width] = lp * batch.mask
        top[rows, :width] = top_lp * batch.mask[..., None]
        ids[rows, :width] = top_ids * batch.mask[..., None].astype(mx.int32)
        mx.eval(out, top, ids)
    return out, TeacherTopK(ids, top)
