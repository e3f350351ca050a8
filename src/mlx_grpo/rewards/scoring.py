"""Scoring a batch: ``RewardSet`` calls every reward function of a run on the N completions (awaiting
async ones concurrently), checks what comes back and combines it into one weighted total per completion
(``RewardScores``); DAPO's overlong penalty is one more term of that total.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlx_grpo.base.errors import UserError
from mlx_grpo.base.user_files import one_line
from mlx_grpo.rewards.builtin import RESERVED_ARGS, RewardFn
from mlx_grpo.rewards.reward_loading import resolve_reward


@dataclass
class RewardScores:
    """Scores of one batch: ``per_func[name]`` is float32 [N] with NaN where the function gave None."""

    names: list[str]
    per_func: dict[str, np.ndarray]
    total: np.ndarray

    def select(self, rows: Sequence[int]) -> "RewardScores":
        """The scores of the given completions, in that order."""
        idx = np.asarray(rows, dtype=np.int64)
        return RewardScores(list(self.names), {k: v[idx] for k, v in self.per_func.items()}, self.total[idx])

    def values(self, reward: str = "") -> np.ndarray:
        """[N] float64: one reward function's scores with None (NaN) counted as 0, as the total counts it;
        reward "" = the total."""
        return np.nan_to_num(np.asarray(self.total if not reward else self.per_func[reward], dtype=np.float64), nan=0.0)

    def with_penalty(self, name: str, values: np.ndarray) -> "RewardScores":
        """Add a per-completion term (weight 1) to the total, logged under `name`."""
        values = np.asarray(values, dtype=np.float32)
        return RewardScores(self.names + [name], {**self.per_func, name: values}, self.total + values)

    @staticmethod
    def concat(parts: Sequence["RewardScores"]) -> "RewardScores":
        return RewardScores(list(parts[0].names), {k: np.concatenate([p.per_func[k] for p in parts])
                                                   for k in parts[0].per_func},
                            np.concatenate([p.total for p in parts]))


def overlong_penalty(lengths: np.ndarray, max_new_tokens: int, buffer: int, penalty: float) -> np.ndarray:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) scaled by `penalty`: 0 for lengths up to
    max_new_tokens - buffer, then linear down to -penalty at max_new_tokens. lengths [N] -> [N] float32."""
    start = max_new_tokens - buffer
    over = np.clip((np.asarray(lengths, dtype=np.float64) - start) / buffer, 0.0, 1.0)
    return (-penalty * over).astype(np.float32)


class RewardSet:
    """The reward functions of a run with their weights.

    ``total`` is the weighted sum with None (NaN) counted as 0: a function that does not apply to a
    completion neither rewards nor penalises it (the same as TRL's nansum), and one bad function
    cannot turn every advantage into NaN.
    """

    def __init__(self, names: list[str], weights: list[float] | None = None, base_dir: Path | None = None,
                 extra: Sequence[tuple[str, RewardFn, float]] = (), allow_empty: bool = False):
        """Resolve names (built-in, or 'file.py:function' relative to base_dir); weights default to 1.0.
        `extra` adds ready-made functions as (name, function, weight), e.g. the HTTP reward. allow_empty: no
        function at all scores 0 (pure distillation, where a teacher gives the signal)."""
        if not names and not extra and not allow_empty:
            raise UserError("no reward functions given (e.g. rewards: [correctness, xmlcount])")
        resolved = [resolve_reward(n, base_dir) for n in names]
        self.names = [key for key, _ in resolved]
        dupes = sorted({n for n in self.names if self.names.count(n) > 1})
        if dupes:
            raise UserError(f"reward function listed twice: {', '.join(dupes)}")
        self.functions = dict(resolved)
        if not weights:  # None or [] (the config default) both mean "all 1.0"
            weights = [1.0] * len(names)
        if len(weights) != len(names):
            raise UserError(
                f"reward_weights has {len(weights)} values but there are {len(names)} reward functions "
                f"({', '.join(self.names)})"
            )
        if not all(isinstance(w, (int, float)) and math.isfinite(w) for w in weights):
            raise UserError(f"reward_weights must be finite numbers, got {list(weights)}")
        self.weights = [float(w) for w in weights]
        for name, fn, weight in extra:
            if name in self.functions:
                raise UserError(f"reward function listed twice: {name}")
            self.names.append(name)
            self.functions[name] = fn
            self.weights.append(float(weight))

    def score(
        self,
        prompts: Sequence[Any],
        completions: Sequence[str],
        completion_ids: Sequence[Sequence[int]],
        columns: dict[str, list],
        transcripts: Sequence[Any] | None = None,
    ) -> RewardScores:
        """Run every function on the N completions; columns hold one value per completion; transcripts (a
        multi-turn run's episodes, environments.Transcript) are passed as `transcripts=` when given. Functions
        that return awaitables (`async def`) are awaited concurrently, so network-bound scorers overlap."""
        n = len(completions)
        clash = sorted(RESERVED_ARGS & set(columns))
        if clash:
            raise UserError(f"data column '{clash[0]}' clashes with a reward-function argument; rename it")
        kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        if transcripts is not None:
            kwargs["transcripts"] = transcripts
        outputs = {}
        for name, fn in self.functions.items():
            try:
                outputs[name] = fn(**kwargs)
            except Exception as e:
                _raise_failed(name, e)
        awaiting = {k: v for k, v in outputs.items() if inspect.isawaitable(v)}  # async functions, any form
        if awaiting:
            outputs.update(_await_all(awaiting))
        per_func = {}
        for name, values in outputs.items():
            if isinstance(values, BaseException):
                _raise_failed(name, values)
            per_func[name] = _check_values(name, values, n)
        total = np.zeros(n, dtype=np.float32)
        for name, w in zip(self.names, self.weights):
            total += w * np.nan_to_num(per_func[name], nan=0.0)
        return RewardScores(names=list(self.names), per_func=per_func, total=total)


def _raise_failed(name: str, exc: BaseException):
    if isinstance(exc, UserError):  # already says what and where (e.g. the HTTP reward's server is down)
        raise exc
    raise UserError(f"reward function {name} failed: {type(exc).__name__}: {one_line(exc)}") from exc


def _await_all(awaitables: dict[str, Any]) -> dict[str, Any]:
    """Await the coroutines concurrently on one event loop; name -> result or the exception. Inside a
    running loop (a notebook, an async caller) they run on a fresh loop in a helper thread."""
    async def gather():
        return await asyncio.gather(*awaitables.values(), return_exceptions=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return dict(zip(awaitables, asyncio.run(gather())))
    with ThreadPoolExecutor(1) as helper:
        return dict(zip(awaitables, helper.submit(asyncio.run, gather()).result()))


def _check_values(name: str, values: Any, n: int) -> np.ndarray:
    """Turn one function's output into float32 [n] with NaN for None, or say exactly what is wrong."""
    try:
        got = len(values)
    except TypeError:
        raise UserError(
            f"reward function {name} returned {type(values).__name__}, expected a list of {n} floats"
        ) from None
    if got != n:
        raise UserError(f"reward function {name} returned {got} values, expected {n} (one per completion)")
    out = np.empty(n, dtype=np.float32)
    for i, v in enumerate(values):
        if v is None:
            out[i] = np.nan
            continue
        try:
            if isinstance(v, (str, bytes)):
                raise TypeError
            x = float(v)
        except (TypeError, ValueError):
            raise UserError(
                f"reward function {name} returned a non-numeric value at index {i}: {v!r} (expected float or None)"
            ) from None
        if not math.isfinite(x):
            raise UserError(f"reward function {name} returned {x} at index {i}; use None for 'not applicable'")
        out[i] = x
    return out
