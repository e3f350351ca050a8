"""The records handed between the stages of a GRPO update (trainer.py reads them top to bottom):

    Draw         one generation of this rank's prompts x G completions, its rewards submitted
    Batch        one batch step: the rows trained on, their old/reference log-probs, rewards still pending
    UpdateSteps  an update's batch steps as a step source hands them to Trainer.update, with where the data stood
    StepData     what the loss needs of a batch step once scored: rollout, advantages, old/ref log-probs
    TeacherTopK  distill_topk: the teacher's k most likely tokens at each completion position
    BatchStats   what the logs need of a batch step (sampling figures, then its rewards once scored)
    UpdateMetrics  one optimizer update's figures (None where no row entered the loss)
    Counters     the run's position: the whole of its random state (sampling keys and dynamic sampling's waves
                 derive from it)
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from mlx_grpo.data.examples import Example
from mlx_grpo.loss import LossSums
from mlx_grpo.rewards.scoring import RewardScores
from mlx_grpo.rollout.rollout_records import Rollout


@dataclass
class Counters:
    update_step: int = 0
    batch_step: int = 0
    skipped_updates: int = 0
    consecutive_skips: int = 0
    applied_updates: int = 0  # optimizer steps taken: a skipped update leaves the weights as they were
    prompts_cut: int = 0
    draws: int = 0  # rollout generations: batch steps plus dynamic sampling's extra draws (rollout keys)
    # dynamic sampling: the varied groups (all ranks) of each of the run's latest draws (draws.RATE_WINDOW), the
    # rate that sizes its decode waves (draws.wave_size), so which draws are made follows from these counters too
    varied_recent: list[int] = field(default_factory=list)


@dataclass
class Draw:
    """One generation of B prompts x G completions with its rewards."""

    examples: list[Example]  # this rank's share of the batch
    rollout: Rollout
    scores: RewardScores | Future  # a Future while the reward workers score it (draws.draw_scores waits)
    t_rollout: float
    t_reward: float
    flags: np.ndarray | None = None  # [B] groups with reward variance, over all ranks (dynamic sampling)
    sampled: tuple[Rollout, RewardScores] | None = None  # demonstrations: as sampled, before demonstrations


@dataclass
class TeacherTopK:
    """distill_topk: at each completion position of a batch step's rows, the teacher's k most likely next tokens
    and their log-probs under logits / temperature (models/forward.completion_topk), 0 where the mask is 0."""

    ids: mx.array  # [N, T, k] int32
    logprobs: mx.array  # [N, T, k] float32, descending along k


@dataclass
class StepData:
    """One batch step's rows with everything the loss needs."""

    rollout: Rollout
    advantages: mx.array  # [N]
    old_logprobs: mx.array | None  # [N, T]; None: the sampler is the current model (ratio 1 at start)
    ref_logprobs: mx.array | None  # [N, T]; None when kl_coeff = 0
    teacher_logprobs: mx.array | None = None  # [N, T]; on-policy distillation's teacher (None: no teacher)
    teacher_topk: TeacherTopK | None = None  # distill_topk's teacher top-k (None: distill_topk = 0)


@dataclass
class DataPosition:
    """Where the training data stood once an update's batch steps were drawn (async_rollouts' draws for the
    update after it left out): the learning-rate schedule and the logs follow it."""

    batches: int  # batch steps drawn, over all epochs (dynamic sampling's extra draws included)
    epoch: int
    prompts_cut: int


@dataclass
class UpdateSteps:
    """An update's batch steps from a step source (training/step_sources.py, prefetch.py): sampled, their
    old/reference log-prob passes run, their rewards submitted."""

    batches: list[Batch]
    position: DataPosition
    staleness: int | None = None  # async_rollouts: optimizer steps between the sampling and the trained weights


@dataclass
class BatchStats:
    """One batch step's figures for the logs: its sampling (Sampling.logprob_passes) and, once scored
    (Trainer.score), its rewards. Reward, length and variance figures cover every completion drawn."""

    examples: list[Example]  # the groups trained on (this rank's)
    texts: list[str]
    transcripts: list | None
    lengths: np.ndarray  # [drawn rows] tokens sampled
    truncated: np.ndarray  # [drawn rows]
    draws: int
    groups_trained: int
    entropy_sum: float
    tokens: int
    t_rollout: float
    t_logprob: float
    groups_carried: int = 0  # carry_surplus: groups trained on that an earlier batch step drew
    decode_passes: int = 1  # dynamic sampling: the engine passes its draws decoded in (waves of draws decoded together)
    demo: np.ndarray | None = None  # [trained rows] demonstrations
    tool_calls: np.ndarray | None = None  # [drawn rows] tool calls per row (tools runs)
    tool_errors: np.ndarray | None = None
    images: list | None = None  # [trained groups] each prompt's images (image runs, vlm/)
    # the reward part, set by Trainer.score
    rewards: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # [trained rows] totals
    per_func: dict[str, np.ndarray] = field(default_factory=dict)
    advantages: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    drawn_scores: RewardScores | None = None  # every drawn row's scores
    zero_std: float = 0.0
    t_reward: float = 0.0


@dataclass
class Batch:
    """One batch step sampled and through its log-prob passes; its rewards may still be computing in the
    reward workers. Trainer.score collects them (once) into `scored`."""

    rollout: Rollout  # the rows trained on (this rank's)
    old_logprobs: mx.array | None
    ref_logprobs: mx.array | None
    draws: list[Draw]  # every draw of the batch step (dynamic sampling may draw more than one)
    selected: RewardScores | None  # dynamic sampling: the scores of the groups trained on
    stats: BatchStats
    teacher_logprobs: mx.array | None = None  # on-policy distillation: the teacher's log-probs [N, T]
    teacher_topk: TeacherTopK | None = None  # distill_topk: the teacher's top-k at each position
    scored: StepData | None = None


@dataclass
class UpdateMetrics:
    """One optimizer update's figures; the loss and gradient ones are None when no row entered the loss,
    the per-token ones when no token did. Times and memory measure the machine."""

    lr: float
    skipped: bool = True
    loss: float | None = None
    grad_norm: float | None = None
    kl: float | None = None
    clip_fraction: float | None = None
    clip_low_fraction: float | None = None
    clip_high_fraction: float | None = None
    ratio_min: float | None = None
    ratio_mean: float | None = None
    ratio_max: float | None = None
    loss_tokens: int = 0
    sampler_kl: float | None = None
    sampler_diff_max: float | None = None
    is_weight_mean: float | None = None
    is_capped_fraction: float | None = None
    t_train: float = 0.0
    train_tokens: int = 0
    train_tokens_per_s: float = 0.0
    peak_memory_gb: float = 0.0
    time_step_s: float = 0.0
    rollout_staleness: int | None = None  # async_rollouts: updates between the sampling and the trained weights
    teacher_kl: float | None = None  # on-policy distillation: mean log p_student - log p_teacher per token
    forward_kl: float | None = None  # distill_topk: mean loss.topk_forward_kl per token

    @classmethod
    def from_sums(cls, lr: float, sums: LossSums, norm: mx.array, teacher: bool = False,
                  topk: bool = False) -> UpdateMetrics:
        """An update's figures from its (every rank's) LossSums and gradient norm; skipped when either is
        not finite. Per-token figures are None when no token entered the loss; the sampler figures leave
        demonstrations out."""
        loss, tokens, drawn = sums.loss.item(), sums.tokens.item(), sums.sampled_tokens.item()
        per_token = (lambda x: x.item() / tokens) if tokens else (lambda x: None)
        per_drawn = (lambda x: x.item() / drawn) if drawn else (lambda x: None)
        return cls(lr=lr, loss=loss, grad_norm=norm.item(), kl=per_token(sums.kl),
                   skipped=not (math.isfinite(loss) and math.isfinite(norm.item())),
                   clip_low_fraction=per_token(sums.clipped_low), clip_high_fraction=per_token(sums.clipped_high),
                   clip_fraction=per_token(sums.clipped_low + sums.clipped_high),
                   ratio_mean=per_token(sums.ratio), ratio_min=sums.ratio_min.item() if tokens else None,
                   ratio_max=sums.ratio_max.item() if tokens else None, loss_tokens=int(tokens),
                   sampler_kl=per_drawn(sums.sampler_kl),
                   sampler_diff_max=sums.sampler_diff_max.item() if drawn else None,
                   is_weight_mean=per_drawn(sums.is_weight), is_capped_fraction=per_drawn(sums.is_capped),
                   teacher_kl=per_token(sums.teacher_kl) if teacher else None,
                   forward_kl=per_token(sums.forward_kl) if topk else None)
