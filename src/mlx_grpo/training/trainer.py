"""The GRPO update (commands/train.py's loop calls it once per optimizer update, on the batch steps a step source made):

    update(steps)  rewards collected -> advantages -> gradients -> clip -> optimizer step -> UpdateMetrics

One optimizer update consumes `gradient_accumulation_steps` batch steps of B prompts x G completions,
`num_iterations` times (each iteration is one `update` on the same steps, scored once). Data-parallel
(training/distributed.py): every rank samples and scores its own B / ranks of a batch's prompts; the update sums
every rank's rows with the weights the whole batch gives them. Sampling is training/sampling.py's;
checkpoint state is training/job.py's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlx_grpo.config import Config
from mlx_grpo.loss import LossSums, empty_sums, group_advantages
from mlx_grpo.rewards.scoring import RewardScores
from mlx_grpo.training.compiled_update import CompiledUpdate
from mlx_grpo.training.distributed import World, zero_gradients
from mlx_grpo.training.draws import add_rewards, draw_scores
from mlx_grpo.training.optimization import (
    MasterWeights, accumulate_gradients, clip_by_global_norm, learning_rate_at, loss_weights, make_grad_fn,
    make_optimizer, optimizer_step)
from mlx_grpo.training.policy import Policies
from mlx_grpo.training.records import Batch, Counters, StepData, UpdateMetrics, UpdateSteps


@dataclass
class Trainer:
    cfg: Config
    policies: Policies  # policies.model is trained
    masters: MasterWeights  # float32 masters of the trained weights (inactive: the model is trained as is)
    counters: Counters  # shared with the sampling stage, which advances draws and batch steps
    total_updates: int
    pad_id: int
    demonstrator: object = None  # demonstrations.Demonstrator: puts demonstrations into scored draws
    world: World = None

    def __post_init__(self):
        self.world = self.world or World()
        self.model = self.policies.model
        self.optimizer = make_optimizer(self.cfg, learning_rate_at(1, self.total_updates, self.cfg))
        self.grad_fn = make_grad_fn(self.cfg, self.model)
        self.compiled_update = CompiledUpdate(self.optimizer, self.model, self.masters) \
            if self.cfg.training.compile_update else None

    def update(self, steps: UpdateSteps) -> UpdateMetrics:
        """One GRPO update on a step source's batch steps, top to bottom. The reward workers may still be
        scoring them: score() waits."""
        cfg = self.cfg
        self.counters.update_step += 1
        metrics = UpdateMetrics(lr=self.set_learning_rate(steps.position.batches))
        scored = [self.score(b) for b in steps.batches]  # rewards (waiting counts in time_reward_s) -> advantages
        t0 = time.perf_counter()
        grads, sums = self.gradients(scored)  # every rank's rows
        if grads is None:
            self.world.print(f"[mlx-grpo] update {self.counters.update_step}: no completion entered the loss "
                             "(every group was dropped or every completion truncated and masked); update skipped")
        else:
            grads, norm = clip_by_global_norm(grads, cfg.optimizer.max_grad_norm)  # clip
            mx.eval(grads, norm)
            metrics = UpdateMetrics.from_sums(metrics.lr, sums, norm, teacher=self.policies.teacher is not None,
                                              topk=cfg.objective.distill_topk > 0)
            if metrics.skipped:
                self.skip(metrics)
            else:
                self.optimizer_step(grads)  # float32 masters, then the compute copy
        self.policies.after_update(self.counters.update_step, applied=not metrics.skipped)
        metrics.t_train = time.perf_counter() - t0
        metrics.train_tokens = sum(int(s.rollout.lengths.sum()) for s in scored)
        metrics.train_tokens_per_s = metrics.train_tokens / metrics.t_train if metrics.t_train > 0 else 0.0
        metrics.peak_memory_gb = mx.get_peak_memory() / 1e9
        metrics.rollout_staleness = steps.staleness
        return metrics

    # ------------------------------------------------------------------ rewards, advantages
    def score(self, batch: Batch | StepData) -> StepData:
        """A batch step's rewards (waiting for them if the workers are still at it) and advantages, and the
        reward part of its stats; once per batch step (num_iterations reuse it). A StepData is scored."""
        if isinstance(batch, StepData):
            return batch
        if batch.scored is None:
            cfg, draws = self.cfg, batch.draws
            scores = batch.selected if batch.selected is not None else draw_scores(draws[0], cfg, self.demonstrator)
            advantages = self.advantages(scores.total)  # [N]
            drawn = RewardScores.concat([draw_scores(d, cfg, self.demonstrator, sampled=True) for d in draws])
            add_rewards(batch.stats, scores, drawn, advantages, cfg.rollout.num_generations,
                        sum(d.t_reward for d in draws))
            batch.scored = StepData(batch.rollout, advantages, batch.old_logprobs, batch.ref_logprobs,
                                    batch.teacher_logprobs, batch.teacher_topk)
        return batch.scored

    def advantages(self, totals: np.ndarray) -> mx.array:
        """Group-normalised advantages [N] of this rank's rows; scale_rewards = batch takes its std over
        the rows of every rank."""
        G, world = self.cfg.rollout.num_generations, self.world
        if self.cfg.objective.scale_rewards != "batch" or world.size == 1:
            return group_advantages(mx.array(totals), G, self.cfg.objective.scale_rewards)
        parts = world.gather(totals, "the batch reward scale")
        start = sum(len(p) for p in parts[:world.rank])
        return group_advantages(mx.array(np.concatenate(parts)), G, "batch")[start:start + len(totals)]

    # ------------------------------------------------------------------ gradients, step
    def set_learning_rate(self, drawn: int) -> float:
        lr = learning_rate_at(self.schedule_position(drawn), self.total_updates, self.cfg)
        self.optimizer.learning_rate = mx.array(lr, dtype=mx.float32)
        return lr

    def schedule_position(self, drawn: int) -> int:
        """The update's place in the learning-rate schedule, by data consumed (`drawn` batch steps): the
        update count when every batch step draws once; ahead of it when dynamic sampling drew extra batches,
        so the decay ends where the data does. 1-based."""
        cfg = self.cfg
        groups = -(-drawn // cfg.training.gradient_accumulation_steps)  # rollout groups consumed
        iteration = (self.counters.update_step - 1) % cfg.objective.num_iterations + 1
        return min(max(groups - 1, 0) * cfg.objective.num_iterations + iteration, self.total_updates)

    def gradients(self, steps: list[StepData]) -> tuple[object, LossSums | None]:
        """The update's gradient and LossSums over the rows of every rank (None, None when no row enters
        the loss anywhere)."""
        cfg = self.cfg
        weights = loss_weights(cfg, steps, self.world)
        if cfg.model.lora_dropout > 0:  # dropout masks come from the global generator: derive them from the run's seed
            mx.random.seed((self.world.seed(cfg.run.seed) * 1_000_003 + self.counters.update_step) % 2 ** 63)
        self.model.train()
        try:
            grads, sums = accumulate_gradients(self.grad_fn, steps, weights, cfg.training.micro_batch_size, self.pad_id,
                                               cfg.training.micro_batch_tokens)
        finally:
            self.model.eval()
        if self.world.size == 1:
            return grads, sums
        if grads is None:  # none of this rank's rows counts; the others' may
            grads, sums = zero_gradients(self.model), empty_sums()
        grads, sums = self.world.average_gradients(grads), self.world.reduce_sums(sums)
        return (grads, sums) if sums.tokens.item() > 0 else (None, None)

    def optimizer_step(self, grads) -> None:
        """The optimizer step on the clipped gradient (compile_update: as one compiled function)."""
        if self.compiled_update is not None:
            self.compiled_update.step(grads)
        else:
            optimizer_step(self.optimizer, self.model, grads, self.masters)
        # Hand this update's freed buffers (rollout KV caches, activations, optimizer transients) back to
        # the device rather than keep them cached beside AdamW's state for the next rollout: near the
        # memory limit (a 1.9B model on an H100) later updates slowed several-fold (BENCHMARKS.md).
        mx.clear_cache()
        self.counters.consecutive_skips = 0
        self.counters.applied_updates += 1

    def skip(self, metrics: UpdateMetrics) -> None:
        """A non-finite loss or gradient: the update is not applied; too many in a row stop the run."""
        self.counters.skipped_updates += 1
        self.counters.consecutive_skips += 1
        self.world.print(f"[mlx-grpo] update {self.counters.update_step}: non-finite loss or gradient "
                         f"(loss={metrics.loss}, grad_norm={metrics.grad_norm}); update skipped")
        if self.counters.consecutive_skips >= self.cfg.health.max_consecutive_skips:  # the same on every rank
            self.world.fail(f"{self.counters.consecutive_skips} consecutive updates had a non-finite loss or "
                            "gradient; stopping (try a lower learning_rate or max_grad_norm). The weights "
                            "of the last finite update are in the latest checkpoint.")
