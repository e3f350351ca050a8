"""Step sources: where commands/train.py's loop gets each update's batch steps. One interface, three implementations
chosen by the config (`step_source`), each over the same sampling stage (training/sampling.py):

    FreshSteps      the update's batch steps drawn together, their rollouts decoding together (engine refill)
    DynamicSteps    dynamic_sampling: batch steps one by one, each drawing more prompts until enough groups
                    have rewards that differ, the draws it needs decoded together in waves (Sampling.waves)
    PrefetchSteps   async_rollouts: each update's rollouts decoded during the update before (prefetch.py)

    next()              -> UpdateSteps, or None when the data has run out
    wait()              until no rollout is in flight (evaluations share the tools with it)
    checkpoint_state(s) the trainer state a checkpoint records, given the run's (prefetch: before its draws)
    sampling_weights    the weights rollouts in flight are sampled from (saved as the old policy), or None
    resume(old, state)  a checkpoint's old policy and state, for the first rollouts after a resume
    close()
"""

from __future__ import annotations

from mlx_grpo.training.records import UpdateSteps
from mlx_grpo.training.sampling import Sampling


class FreshSteps:
    """Each update's batch steps sampled when the update asks for them."""

    exhausted = False  # the data never runs out before the update count: total_updates is computed from it
    sampling_weights = None

    def __init__(self, sampling: Sampling):
        self.sampling = sampling

    def next(self) -> UpdateSteps | None:
        s = self.sampling
        batches = [s.next_examples() for _ in range(s.cfg.training.gradient_accumulation_steps)]
        if any(b is None for b in batches):
            return None
        s.prompts.new_update()
        draws = s.sample(batches)  # decoded together, rewards submitted
        return UpdateSteps([s.logprob_passes([d]) for d in draws], s.position())  # rewards computing meanwhile

    def wait(self) -> None:
        """Nothing is in flight between updates."""

    def checkpoint_state(self, state: dict) -> dict:
        return state

    def resume(self, old: dict | None, state: dict) -> None:
        """The next update samples fresh from the restored weights."""

    def close(self) -> None:
        """Nothing runs in the background."""


class DynamicSteps(FreshSteps):
    """dynamic_sampling: the batch steps one by one, each drawing until enough groups vary in reward, in waves of
    draws decoded together (Sampling.waves). The wave sizes follow the varied-group rate of the run's latest
    draws, kept in the counters (Counters.varied_recent), so checkpoints and resumes carry it as they carry
    the draw counter."""

    def next(self) -> UpdateSteps | None:
        s = self.sampling
        if self.exhausted:
            return None
        s.prompts.new_update()
        batches = []
        for _ in range(s.cfg.training.gradient_accumulation_steps):
            examples = s.next_examples()
            if examples is None:  # extra draws used the data up: this update trains on the steps it has
                self.exhausted = True
                break
            batches.append(s.batch_step(examples))
        return UpdateSteps(batches, s.position()) if batches else None
