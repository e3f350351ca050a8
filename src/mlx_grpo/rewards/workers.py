"""Where reward functions run: inline, or in a worker pool off the training loop's critical path.

The trainer submits a batch's completions as soon as they are generated and collects the scores only
when the update needs them, so the log-prob passes and the next rollouts of an accumulation group run
on the GPU meanwhile. Scores do not depend on where they were computed: a pooled run equals an inline
one. Process workers rebuild the RewardSet from its names (user reward files are re-imported there),
in processes started with "spawn", so no GPU state is forked.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mlx_grpo.base.errors import UserError
from mlx_grpo.rewards.scoring import RewardScores, RewardSet

EXECUTORS = ("thread", "process")


def build_reward_set(cfg, base_dir: Path) -> RewardSet:
    """The run's reward functions: reward_funcs, plus the HTTP reward and the reward model when set."""
    from mlx_grpo.rewards.http import HttpReward

    w = cfg.rewards  # the rewards group: all this needs
    extra = []
    if w.reward_url:
        extra.append(("reward_url", HttpReward(w.reward_url, w.reward_url_timeout, w.reward_url_retries,
                                               w.reward_url_allowed_hosts), w.reward_url_weight))
    if w.reward_model:  # MLX: only ever built in the training process (config refuses it with workers)
        from mlx_grpo.rewards.reward_model import RewardModelReward

        extra.append(("reward_model", RewardModelReward(w.reward_model, w.reward_model_clip,
                                                        w.reward_model_answer_weight, w.reward_model_batch_size),
                      w.reward_model_weight))
    # pure distillation (a teacher and no reward function, config/validation.py): every completion scores 0
    return RewardSet(w.reward_funcs, w.reward_weights or None, base_dir=base_dir, extra=extra,
                     allow_empty=cfg.objective.distill_coeff > 0)


# Each process worker holds the RewardSet its initializer built (one per worker process, never shared).
_worker_rewards: RewardSet | None = None


def _init_process_worker(cfg, base_dir: Path) -> None:
    global _worker_rewards
    _worker_rewards = build_reward_set(cfg, base_dir)


def _score_in_process(prompts, completions, completion_ids, columns, transcripts) -> RewardScores:
    return _worker_rewards.score(prompts, completions, completion_ids, columns, transcripts)


class RewardRunner:
    """submit(batch) -> Future of RewardScores; inline (workers = 0) the future is already done."""

    def __init__(self, rewards: RewardSet, cfg, base_dir: Path):
        self.rewards = rewards
        self.pool: Executor | None = None
        if cfg.rewards.reward_workers > 0 and cfg.rewards.reward_executor == "thread":
            self.pool = ThreadPoolExecutor(cfg.rewards.reward_workers, thread_name_prefix="mlx-grpo-reward")
        elif cfg.rewards.reward_workers > 0:
            self.pool = ProcessPoolExecutor(cfg.rewards.reward_workers, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_init_process_worker, initargs=(cfg, base_dir))

    def submit(self, prompts: list[Any], completions: list[str], completion_ids: list[list[int]],
               columns: dict[str, list], transcripts: list | None = None) -> Future:
        if self.pool is None:
            done: Future = Future()
            try:
                done.set_result(self.rewards.score(prompts, completions, completion_ids, columns, transcripts))
            except UserError as e:
                done.set_exception(e)
            return done
        if isinstance(self.pool, ThreadPoolExecutor):
            return self.pool.submit(self.rewards.score, prompts, completions, completion_ids, columns, transcripts)
        return self.pool.submit(_score_in_process, prompts, completions, completion_ids, columns, transcripts)

    def close(self, wait: bool = True) -> None:
        """Stop the workers; wait=False (leaving on an error or Ctrl-C) does not wait for running rewards."""
        if self.pool is not None:
            self.pool.shutdown(wait=wait, cancel_futures=True)
