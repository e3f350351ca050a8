"""The pieces of a batch step's sampling stage that need no trainer state: each row's sampling key, what
the rewards are given of a draw, collecting a draw's scores (length penalty, demonstrations), dynamic
sampling's choice of groups (trained, carried) and the size of its decode waves, and the batch step's figures
for the logs."""

from __future__ import annotations

import time
from concurrent.futures import BrokenExecutor

import mlx.core as mx
import numpy as np

from mlx_grpo.data.examples import Example, reward_columns
from mlx_grpo.base.errors import UserError
from mlx_grpo.rewards.scoring import RewardScores, overlong_penalty
from mlx_grpo.rollout.multiturn import model_texts, tool_use
from mlx_grpo.rollout.rollout_records import Rollout, select_groups
from mlx_grpo.training.records import BatchStats, Draw


def row_keys(seed: int, draw: int, rows: int, share: slice) -> mx.array:
    """The sampling keys [n, 2] of the rows in `share` of a draw's `rows` rows: a row's key depends on
    its place in the whole batch, not on which rank samples it."""
    draw_key = mx.random.split(mx.random.key(seed), draw + 1)[draw]
    return mx.random.split(draw_key, rows)[share]


def reward_inputs(examples: list[Example], rollout: Rollout, group_size: int, prefill: str) -> tuple:
    """(prompts, completions, completion_ids, columns, transcripts) of a draw's N rows, as RewardSet.score
    takes them. Each completion's own ids, up to and including its end token (as TRL passes them), not
    padded rows; multi-turn: rewards score what the model wrote, as evaluation does; `transcripts` gives
    them the whole episode, completion_ids every token of it."""
    G = group_size
    columns = {k: [v for v in values for _ in range(G)] for k, values in reward_columns(examples).items()}
    prompts = [e.prompt for e in examples for _ in range(G)]
    ids = [row[:n] for row, n in zip(rollout.completion_ids.tolist(), rollout.extents.tolist())]
    return prompts, model_texts(rollout, prefill), ids, columns, rollout.transcripts


def collect(draw: Draw, cfg, demonstrator) -> None:
    """Wait for a draw's scores, add the length penalty and put in its demonstrations (scored inline)."""
    t0 = time.perf_counter()
    try:
        scores = draw.scores.result()
    except BrokenExecutor as e:
        raise UserError(f"the reward workers stopped ({type(e).__name__}: {e}); try reward_executor = thread "
                        "or reward_workers = 0") from None
    if cfg.rewards.overlong_penalty > 0:
        scores = scores.with_penalty("overlong_penalty", overlong_penalty(
            draw.rollout.extents, cfg.rollout.max_new_tokens, cfg.rewards.overlong_buffer,
            cfg.rewards.overlong_penalty))
    draw.scores = scores
    if demonstrator is not None:  # groups that earned nothing get a demonstration (data/demonstrations.py)
        draw.sampled = (draw.rollout, scores)
        draw.rollout, draw.scores = demonstrator.inject(draw.examples, draw.rollout, scores)
    draw.t_reward += time.perf_counter() - t0  # time the loop waited: the whole scoring when inline


def draw_scores(draw: Draw, cfg, demonstrator, sampled: bool = False) -> RewardScores:
    """A draw's rewards plus the length penalty, waiting for them if the workers are still at it; with
    demonstrations, those of the rows trained on (sampled: of the rows as sampled)."""
    if not isinstance(draw.scores, RewardScores):
        collect(draw, cfg, demonstrator)
    return draw.sampled[1] if sampled and draw.sampled is not None else draw.scores


def varied_groups(scores: RewardScores, group_size: int, reward: str = "") -> np.ndarray:
    """[B] bool: the groups whose scores of `reward` (a reward function's name; "" = the total) are not all
    equal, None counting as 0 as in the total: a group where the function never applies is not varied."""
    return np.ptp(scores.values(reward).reshape(-1, group_size), axis=1) > 0


# Dynamic sampling's varied-group rate is measured over this many of the run's latest draws (Counters.varied_recent):
# recent enough to follow a policy that learns (the share of all-correct groups grows), long enough to be steady.
RATE_WINDOW = 16


def wave_size(recent: list[int], deficit: int, room: int) -> int:
    """Dynamic sampling: how many draws to decode together in one pass (a wave) for `deficit` more varied
    groups, from `recent` (the varied groups, all ranks, of each of the run's latest draws): the draws the
    deficit needs at their mean, ceil(deficit / (sum(recent) / len(recent))); one with nothing measured yet
    (a run's first draw), all `room` (the draws left under max_resample_batches) when none of them varied.
    At most `room`, at least 1."""
    if not recent:
        return 1
    if not sum(recent):
        return room
    return max(1, min(room, -(-deficit * len(recent) // sum(recent))))


def choose_groups(flags: list[np.ndarray], batch_size: int, keep: int) -> tuple[list, list]:
    """Dynamic sampling's choice over a batch step's draws in order (flags[i]: draw i's groups over all ranks,
    from varied_groups; carried draws first, their flags marking the groups carried): the first batch_size
    varied groups are trained on, the next `keep` (carry_surplus: batch_size - 1; else 0) are carried to the
    next batch step, the rest are dropped. -> (trained, carried), each [(draw index, group index)] in order."""
    varied = [(i, int(g)) for i, f in enumerate(flags) for g in np.flatnonzero(f)]
    return varied[:batch_size], varied[batch_size:batch_size + keep]


def informative_batch(draws: list[Draw], chosen: list[tuple[int, int]], share: slice,
                      pad_id: int) -> tuple[list[Example], Rollout, RewardScores]:
    """Dynamic sampling: the chosen groups [(draw index, group index over all ranks)] (choose_groups) as one
    batch; this rank keeps those of its own `share` (ranks may train on unequal numbers). Scores must be
    collected."""
    G = draws[0].rollout.group_size
    picks = [(i, g - share.start) for i, g in chosen if share.start <= g < share.stop]
    rollout = select_groups([d.rollout for d in draws], picks, pad_id)
    scores = RewardScores.concat([draws[i].scores.select(range(g * G, (g + 1) * G)) for i, g in picks]) \
        if picks else draws[0].scores.select([])
    return [draws[i].examples[g] for i, g in picks], rollout, scores


def batch_stats(draws: list[Draw], examples: list[Example], rollout: Rollout, t_logprob: float,
                tools: bool) -> BatchStats:
    """A batch step's sampling figures: of every row the policy drew (before demonstrations replaced
    any), and of the rows trained on."""
    drawn = [d.rollout if d.sampled is None else d.sampled[0] for d in draws]  # the policy's samples
    stats = BatchStats(examples=examples, texts=rollout.texts, transcripts=rollout.transcripts,
                       lengths=np.concatenate([r.lengths for r in drawn]),
                       truncated=np.concatenate([r.truncated for r in drawn]), draws=len(draws),
                       groups_trained=len(examples),
                       entropy_sum=float(sum(np.array(r.entropies).sum() for r in drawn)),
                       tokens=int(sum(r.lengths.sum() for r in drawn)),
                       t_rollout=sum(d.t_rollout for d in draws), t_logprob=t_logprob,
                       demo=rollout.demo)  # which trained rows are demonstrations (demo_fraction, completions)
    if drawn[0].transcripts is not None and tools:  # tools: calls (failed ones) per row
        stats.tool_calls, stats.tool_errors = tool_use([t for r in drawn for t in r.transcripts])
    return stats


def add_rewards(stats: BatchStats, trained: RewardScores, drawn: RewardScores, advantages: mx.array,
                group_size: int, t_reward: float) -> None:
    """The reward part of a batch step's figures, once its scores are in."""
    stats.rewards, stats.per_func = trained.total, trained.per_func
    stats.advantages = np.array(advantages.tolist())
    stats.drawn_scores = drawn
    stats.zero_std = float(np.mean(~varied_groups(drawn, group_size)))  # of the total, whatever dynamic_sampling keys
    stats.t_reward = t_reward
