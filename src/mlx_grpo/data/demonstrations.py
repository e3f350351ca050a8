"""Demonstrations in the group: off-policy guidance as in LUFFY (Yan et al. 2025, "Learning to Reason under
Off-Policy Guidance", arXiv 2504.14945). With `demonstrations = zero_groups`, a group none of whose sampled
completions earned anything (> 0 of the total reward, or of `demo_reward`) has its LAST completion replaced
by the example's reference solution in the run's format (data/solutions.py: the data's `completion` column,
GSM8K's worked solution, the one `arith` writes); the group's advantages are then computed with the
demonstration in it, so the group has something to reinforce where it had nothing.

This module owns the group surgery: which groups get one, the demonstration's tokens, the rollout with the
replaced rows (marked in Rollout.demo) and their rewards, scored by the run's own reward functions. The
objective is loss.py's: a demonstration row trains under the same clipped PPO ratio against the rollout
policy's log-probs of its tokens, teacher-forced by the old-policy pass, and is left out of the rollout
correction and the sampler figures, having no sampler log-probs (docs/algorithms-demonstrations.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np

from mlx_grpo.base.errors import UserError
from mlx_grpo.data.examples import Example, reward_columns
from mlx_grpo.data.solutions import Style, after_prefill, reference_completion, style_for
from mlx_grpo.rewards.scoring import RewardScores, RewardSet, overlong_penalty
from mlx_grpo.rollout.rollout_records import Rollout


def groups_without_reward(scores: RewardScores, group_size: int, reward: str = "") -> np.ndarray:
    """[B] bool: the groups where no completion earned anything (> 0) of `reward` (a reward function's
    name; "" = the total reward). A function's None (NaN: not applicable) counts as nothing earned."""
    earned = scores.values(reward).reshape(-1, group_size) > 0  # [B, G]
    return ~earned.any(axis=1)


def demo_ids(tokenizer, text: str, prefill: str, end_id: int) -> list[int]:
    """The completion ids of a demonstration whose text (as rewards see it) is `text`: what follows the
    prefill (the prompt already ends with it), encoded alone as a continuation, then the end token."""
    rest = after_prefill(text, prefill)
    if rest is None:
        raise UserError(_unprefilled(text, prefill))
    return list(tokenizer.encode(rest, add_special_tokens=False)) + [end_id]


def _unprefilled(text: str, prefill: str) -> str:
    return (f"demonstrations: a reference completion does not begin with the prefill {prefill!r} (it begins "
            f"{text[:40]!r}); write the data's 'completion' column in the run's format, prefill included, or change "
            "the prefill")


def check_references(cfg, examples: Sequence[Example]) -> str | None:
    """Before a run with demonstrations (the model not loaded yet): refuse one where they can never apply, no
    training example having a reference solution (the run would end with demo_fraction 0 and nothing said),
    and a reference the prefill does not open (found at start, not at the first group that needs it).
    -> a note when only some examples have one (the others' groups never get a demonstration), else None."""
    style = style_for(cfg)
    texts = [t for t in (reference_completion(e, style) for e in examples) if t is not None]
    if not texts:
        raise UserError(f"demonstrations = {cfg.objective.demonstrations}, but none of the {len(examples)} training "
                        "examples has a reference solution to demonstrate (a 'completion' or 'solution' column, or "
                        "GSM8K's or arith's worked solution), so no group could ever get one: use data with such a "
                        "column, or set demonstrations = off")
    for text in texts:
        if after_prefill(text, cfg.data.prefill) is None:
            raise UserError(_unprefilled(text, cfg.data.prefill))
    missing = len(examples) - len(texts)
    if not missing:
        return None
    return (f"[mlx-grpo] note: no reference solution in {missing} of the {len(examples)} training examples: their "
            "groups never get a demonstration")


def with_demonstrations(rollout: Rollout, demos: dict[int, list[int]], texts: dict[int, str],
                        pad_id: int) -> Rollout:
    """The rollout with rows {row: ids} replaced by demonstrations (ids ending in their end token): mask 1
    over their ids, sampler log-prob and entropy 0 (nothing sampled them), not truncated, marked in `demo`.
    Completions widen to the longest demonstration (pad_id, mask 0 after each row's end)."""
    N, T = rollout.completion_ids.shape
    width = max([T] + [len(ids) for ids in demos.values()])

    def widened(a: mx.array, fill, dtype) -> np.ndarray:  # [N, T] -> [N, width]
        out = np.full((N, width), fill, dtype=dtype)
        out[:, :T] = np.array(a.astype(mx.float32) if dtype != np.int32 else a, dtype=dtype)
        return out

    ids = widened(rollout.completion_ids, pad_id, np.int32)
    mask = widened(rollout.mask, 0.0, np.float32)
    sampler = widened(rollout.sampler_logprobs, 0.0, np.float32)
    entropies = None if rollout.entropies is None else widened(rollout.entropies, 0.0, np.float32)
    truncated, row_texts = rollout.truncated.copy(), list(rollout.texts)
    demo = np.zeros(N, dtype=bool) if rollout.demo is None else rollout.demo.copy()
    for r, d in demos.items():
        ids[r], mask[r], sampler[r] = pad_id, 0.0, 0.0
        ids[r, :len(d)], mask[r, :len(d)] = d, 1.0
        if entropies is not None:
            entropies[r] = 0.0
        truncated[r], row_texts[r], demo[r] = False, texts[r], True
    return dataclasses.replace(rollout, completion_ids=mx.array(ids), mask=mx.array(mask),
                               sampler_logprobs=mx.array(sampler),
                               entropies=None if entropies is None else mx.array(entropies),
                               truncated=truncated, texts=row_texts, demo=demo)


def with_scores(scores: RewardScores, rows: Sequence[int], demo: RewardScores) -> RewardScores:
    """scores with the given rows' per-function rewards and totals replaced by demo's (in that order)."""
    idx = np.asarray(rows, dtype=np.int64)
    per_func = {k: v.copy() for k, v in scores.per_func.items()}
    for k in per_func:
        per_func[k][idx] = demo.per_func[k]
    total = scores.total.copy()
    total[idx] = demo.total
    return RewardScores(list(scores.names), per_func, total)


class Demonstrator:
    """Puts demonstrations into the groups of a draw that earned nothing, scored by the run's rewards.

    The choice is a function of the draw's rewards and examples alone (no randomness, no state but a
    warned-once flag), so a resumed run injects exactly what the uninterrupted one did."""

    def __init__(self, cfg, tokenizer, rewards: RewardSet, pad_id: int, warn: Callable[[str], None]):
        self.cfg, self.tokenizer, self.rewards, self.pad_id, self.warn = cfg, tokenizer, rewards, pad_id, warn
        ends = sorted(tokenizer.eos_token_ids)
        self.end_id = tokenizer.eos_token_id if tokenizer.eos_token_id in ends else ends[0]
        self._warned_long = False
        self.style: Style = style_for(cfg)  # single-turn (validation.py): no tool syntax to write

    def inject(self, examples: list[Example], rollout: Rollout, scores: RewardScores
               ) -> tuple[Rollout, RewardScores]:
        """The draw's rollout and scores with a demonstration in place of the last completion of each group
        that earned nothing and whose example has a reference; rollout.demo marks the rows (all False when
        none)."""
        cfg, G = self.cfg, self.cfg.rollout.num_generations
        demos, texts = {}, {}
        for g in np.flatnonzero(groups_without_reward(scores, G, cfg.objective.demo_reward)):
            text = reference_completion(examples[g], self.style)
            if text is None:
                continue
            ids = demo_ids(self.tokenizer, text, cfg.data.prefill, self.end_id)
            if len(ids) > cfg.rollout.max_new_tokens:  # a cut demonstration would show an unfinished answer
                if not self._warned_long:
                    self._warned_long = True
                    self.warn(f"[mlx-grpo] warning: a reference completion of {len(ids)} tokens exceeds "
                              f"max_new_tokens ({cfg.rollout.max_new_tokens}): such examples get no demonstration; "
                              "raise max_new_tokens")
                continue
            r = int(g) * G + G - 1  # the group's last completion: deterministic
            demos[r] = ids
            # the text as rewards see sampled rows': prefill + the decoded tokens before the end token
            texts[r] = cfg.data.prefill + self.tokenizer.decode(ids[:-1])
        if not demos:
            return dataclasses.replace(rollout, demo=np.zeros(len(rollout.texts), dtype=bool)), scores
        rows = sorted(demos)
        mine = [examples[r // G] for r in rows]
        demo_scores = self.rewards.score([e.prompt for e in mine], [texts[r] for r in rows],
                                         [demos[r] for r in rows], reward_columns(mine))
        if cfg.rewards.overlong_penalty > 0:  # the same length penalty as the sampled rows
            demo_scores = demo_scores.with_penalty("overlong_penalty", overlong_penalty(
                np.array([len(demos[r]) for r in rows]), cfg.rollout.max_new_tokens, cfg.rewards.overlong_buffer,
                cfg.rewards.overlong_penalty))
        return with_demonstrations(rollout, demos, texts, self.pad_id), with_scores(scores, rows, demo_scores)
