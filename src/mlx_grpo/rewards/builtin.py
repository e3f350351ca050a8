"""Reward functions: the answer/format parsers, the built-in GSM8K-style rewards,
loading of user reward files (``path/file.py:function``) and ``RewardSet``, which
calls every reward on a batch of completions, validates what comes back and
combines the results into one weighted score per completion.

Every reward has the TRL-like signature
``fn(prompts, completions, completion_ids, **columns) -> list[float | None]``;
``None`` means "not applicable to this completion".
"""

from __future__ import annotations

import asyncio
import difflib
import hashlib
import importlib.util
import inspect
import math
import re
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np

from mlx_grpo.config import SYSTEM_PROMPT  # noqa: F401  (re-exported: the prompt the format rewards expect)
from mlx_grpo.errors import UserError

RewardFn = Callable[..., Sequence[float | None]]

_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)")
_INTEGER = re.compile(r"-?\d+")
_STRICT = re.compile(r"^<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\n?$", re.DOTALL)
_SOFT = re.compile(r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>", re.DOTALL)
_XML_TAGS = ("<reasoning>", "</reasoning>", "<answer>", "</answer>")
# R1-style reasoning format: the think block then the answer block, optionally a blank line between.
_THINK = re.compile(r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$", re.DOTALL)
_THINK_SPACED = re.compile(r"^<think>\n.*?\n</think>\n\n<answer>\n.*?\n</answer>$", re.DOTALL)
_THINK_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
# Keyword names the reward call itself uses; a data column may not reuse them.
RESERVED_ARGS = frozenset({"prompts", "completions", "completion_ids", "transcripts"})


# ---------------------------------------------------------------- parsing


def extract_answer(text: str) -> str | None:
    """The stripped text inside the last ``<answer>...</answer>``; None if there is none."""
    end = text.rfind("</answer>")
    if end < 0:
        return None
    # The last opening tag before the last closing tag, so nested/repeated tags resolve to the innermost tail.
    start = text.rfind("<answer>", 0, end)
    if start < 0:
        return None
    return text[start + len("<answer>") : end].strip()


def _normalize_number(text: str) -> str:
    """Drop the decorations models add to numbers: thousands commas, ``$`` and surrounding spaces."""
    return re.sub(r"[,$]", "", text).strip()


def answers_match(pred: str | None, gold: str | None) -> bool:
    """Numbers compare by value ("1,000" == "1000", "$5" == "5.0"); anything else as stripped text."""
    if pred is None or gold is None:
        return False
    p, g = _normalize_number(str(pred)), _normalize_number(str(gold))
    if _NUMBER.fullmatch(p) and _NUMBER.fullmatch(g):
        # Exact decimal comparison: no float rounding, and no limit on digits (Fraction parses through int,
        # which refuses strings over 4,300 digits).
        return Decimal(p) == Decimal(g)
    return str(pred).strip() == str(gold).strip()


def _text(completion: Any) -> str:
    """Completions are texts; tolerate TRL's conversational form (a list of messages) by taking the last one."""
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


# ---------------------------------------------------------------- built-in rewards


def correctness(prompts, completions, completion_ids, answer=None, **columns) -> list[float]:
    """2.0 when the extracted answer equals the gold ``answer`` column, else 0.0."""
    if answer is None:
        raise ValueError("needs an 'answer' column with the gold answers")
    return [2.0 if answers_match(extract_answer(_text(c)), a) else 0.0 for c, a in zip(completions, answer)]


def int_reward(prompts, completions, completion_ids, **columns) -> list[float]:
    """0.5 when the extracted answer is an integer ("-12", "1,000", "$5"), else 0.0."""
    out = []
    for c in completions:
        pred = extract_answer(_text(c))
        out.append(0.5 if pred is not None and _INTEGER.fullmatch(_normalize_number(pred)) else 0.0)
    return out


def strict_format(prompts, completions, completion_ids, **columns) -> list[float]:
    """0.5 when the whole completion is exactly the reasoning/answer layout, newlines included."""
    return [0.5 if _STRICT.match(_text(c)) else 0.0 for c in completions]


def soft_format(prompts, completions, completion_ids, **columns) -> list[float]:
    """0.5 when a reasoning block followed by an answer block appears anywhere."""
    return [0.5 if _SOFT.search(_text(c)) else 0.0 for c in completions]


def xmlcount_score(text: str) -> float:
    """0.125 per tag present exactly once, minus 0.001 per character after the last ``</answer>``.

    Not clamped: a long tail after the answer can push the score below zero, which is the point
    (it discourages rambling after the answer).
    """
    score = sum(0.125 for tag in _XML_TAGS if text.count(tag) == 1)
    end = text.rfind("</answer>")
    if end >= 0:
        score -= 0.001 * len(text[end + len("</answer>") :])
    return score


def xmlcount(prompts, completions, completion_ids, **columns) -> list[float]:
    """Partial credit for the format tags; see ``xmlcount_score``."""
    return [xmlcount_score(_text(c)) for c in completions]


def think_format(prompts, completions, completion_ids, **columns) -> list[float]:
    """0.5 when the completion is a <think> block then an <answer> block (a blank line between them
    allowed), each tag on its own line; else 0.0."""
    return [0.5 if _THINK.match(t) or _THINK_SPACED.match(t) else 0.0 for t in map(_text, completions)]


def think_tags(prompts, completions, completion_ids, **columns) -> list[float]:
    """0.25 for each of <think>, </think>, <answer>, </answer> present exactly once (up to 1.0)."""
    return [sum(0.25 for tag in _THINK_TAGS if t.count(tag) == 1) for t in map(_text, completions)]


# Reasoning that earns the reasoned_* rewards: at least this many distinct words, one written computation
# ("12 * 3 = 36", "40 - 4") and a number of the question, so "...", filler or one memorised template
# earns nothing (docs/learning.md).
MIN_REASONING_WORDS = 10
_COMPUTATION = re.compile(r"\d\s*(?:[-+*/x×÷=]|times|plus|minus|divided by)\s*\$?\d")
_WORD = re.compile(r"\S*[A-Za-z0-9]\S*")


def reasoning_text(text: str) -> str | None:
    """The text after the first <reasoning> up to </reasoning> (or up to <answer> / the end when the
    tag is never closed); None without a <reasoning> tag."""
    start = text.find("<reasoning>")
    if start < 0:
        return None
    body = text[start + len("<reasoning>"):]
    end = body.find("</reasoning>")
    if end < 0:
        end = body.find("<answer>")
    return body if end < 0 else body[:end]


def _numbers(text: str) -> list[str]:
    return [m.group(0) for m in _NUMBER.finditer(_normalize_number(text))]  # with their signs


def substantive(reasoning: str | None, prompt: Any = "") -> bool:
    """Reasoning with MIN_REASONING_WORDS distinct words, a written computation and, when the question has
    numbers, at least one of them: a constant template that fits every question does not pass."""
    if reasoning is None or len({w.lower() for w in _WORD.findall(reasoning)}) < MIN_REASONING_WORDS \
            or _COMPUTATION.search(reasoning) is None:
        return False
    given = {n.lstrip("+") for n in _numbers(_text(prompt))}
    return not given or any(n.lstrip("+") in given for n in _numbers(reasoning))


def _grounded(text: str, reasoning: str, transcript: Any = None) -> bool:
    """The answer is the number the reasoning arrived at: the value of its last number, or, in a tool run,
    of the last tool answer (the model's own text ends at its call; the result came back as context)."""
    pred, numbers = extract_answer(text), _numbers(reasoning)
    if pred is None:
        return False
    if numbers and answers_match(pred, numbers[-1]):
        return True
    tool_texts = [t.text for t in getattr(transcript, "turns", ()) if t.origin == "tool"]
    results = _numbers(tool_texts[-1]) if tool_texts else []
    return bool(results) and answers_match(pred, results[-1])


def reasoned_correctness(prompts, completions, completion_ids, answer=None, **columns) -> list[float]:
    """2.0 when the answer is right and follows substantive reasoning (see ``substantive``), else 0.0:
    a right answer after empty reasoning earns nothing."""
    if answer is None:
        raise ValueError("needs an 'answer' column with the gold answers")
    return [2.0 if substantive(reasoning_text(t), p) and answers_match(extract_answer(t), a) else 0.0
            for p, t, a in zip(prompts, map(_text, completions), answer)]


def reasoned_format(prompts, completions, completion_ids, transcripts=None, **columns) -> list[float]:
    """Format credit that empty reasoning or a made-up answer cannot earn, up to 0.5: nothing unless the
    reasoning is substantive; then 0.125 for each of <reasoning> and </reasoning> present once, and 0.125
    for each of <answer> and </answer> present once when the answer is the reasoning's last number;
    minus 0.001 per character after </answer> (as xmlcount), never below 0."""
    out = []
    episodes = transcripts if transcripts is not None else [None] * len(prompts)
    for prompt, text, transcript in zip(prompts, map(_text, completions), episodes):
        reasoning = reasoning_text(text)
        if not substantive(reasoning, prompt):
            out.append(0.0)
            continue
        score = sum(0.125 for tag in _XML_TAGS[:2] if text.count(tag) == 1)
        if _grounded(text, reasoning, transcript):
            score += sum(0.125 for tag in _XML_TAGS[2:] if text.count(tag) == 1)
        end = text.rfind("</answer>")
        if end >= 0:
            score -= 0.001 * len(text[end + len("</answer>"):].strip())
        out.append(max(score, 0.0))
    return out


_HASH_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def hash_answer(prompts, completions, completion_ids, answer=None, **columns) -> list[float]:
    """2.0 when the number after the last "####" equals the gold answer (GSM8K's own answer form, which
    nanochat's SFT teaches), else 0.0."""
    if answer is None:
        raise ValueError("needs an 'answer' column with the gold answers")
    out = []
    for c, a in zip(completions, answer):
        found = _HASH_ANSWER.findall(_text(c))
        out.append(2.0 if found and answers_match(found[-1], a) else 0.0)
    return out


def environment_reward(prompts, completions, completion_ids, transcripts=None, **columns) -> list[float | None]:
    """The reward the run's environment gave each episode when it ended it (None where it gave none)."""
    if transcripts is None:
        raise UserError("environment_reward reads the episodes of a multi-turn run: set `environment` (or tools)")
    return [t.reward for t in transcripts]


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "correctness": correctness,
    "int": int_reward,
    "strict_format": strict_format,
    "soft_format": soft_format,
    "xmlcount": xmlcount,
    "think_format": think_format,
    "think_tags": think_tags,
    "reasoned_correctness": reasoned_correctness,
    "reasoned_format": reasoned_format,
    "hash_answer": hash_answer,
    "environment_reward": environment_reward,
}


# ---------------------------------------------------------------- custom rewards


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _import_file(path: Path) -> Any:
    """Execute a user's Python file as a fresh module; its own folder is importable while it loads."""
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    name = f"mlx_grpo_user_reward_{path.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserError(f"reward file {path} cannot be imported as Python (expected a .py file)")
    module = importlib.util.module_from_spec(spec)
    # dataclasses and pickling look the module up in sys.modules while it executes.
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        raise UserError(f"reward file {path} failed to import: {type(e).__name__}: {_one_line(e)}") from e
    finally:
        if str(path.parent) in sys.path:
            sys.path.remove(str(path.parent))
    return module


def _callables_in(module: Any) -> list[str]:
    """Public callables defined in the module itself (not the ones it imported)."""
    names = []
    for attr, value in vars(module).items():
        if attr.startswith("_") or not callable(value):
            continue
        if getattr(value, "__module__", None) == module.__name__:
            names.append(attr)
    return sorted(names)


def load_reward_function(spec: str, base_dir: Path | None = None) -> RewardFn:
    """Load ``"path/to/file.py:function_name"``; a relative path is taken from base_dir (default: cwd)."""
    file_part, sep, func_name = spec.rpartition(":")
    if not sep or not file_part or not func_name:
        raise UserError(f"custom reward '{spec}' must look like path/to/file.py:function_name")
    path = Path(file_part).expanduser()
    if not path.is_absolute():
        path = (base_dir if base_dir is not None else Path.cwd()) / path
    if not path.is_file():
        raise UserError(f"reward file not found: {path} (from reward '{spec}')")
    module = _import_file(path.resolve())
    if not hasattr(module, func_name):
        found = ", ".join(_callables_in(module)) or "none"
        raise UserError(f"reward file {path} has no function '{func_name}' (callables found: {found})")
    fn = getattr(module, func_name)
    if not callable(fn):
        raise UserError(f"reward '{spec}': {func_name} is a {type(fn).__name__}, not a function")
    return fn


# ---------------------------------------------------------------- reward set


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


def _unknown_reward(name: str) -> UserError:
    close = difflib.get_close_matches(name, list(BUILTIN_REWARDS), n=1, cutoff=0.0)
    hint = f"did you mean '{close[0]}'? " if close else ""
    valid = ", ".join(BUILTIN_REWARDS)
    return UserError(
        f"unknown reward function '{name}' ({hint}built-ins: {valid}; custom: path/to/file.py:function)"
    )


def _resolve(name: str, base_dir: Path | None) -> tuple[str, RewardFn]:
    """A name with ':' is a custom file spec (keyed by its function name); anything else is a built-in."""
    if ":" in name:
        return name.rpartition(":")[2], load_reward_function(name, base_dir)
    if name not in BUILTIN_REWARDS:
        raise _unknown_reward(name)
    return name, BUILTIN_REWARDS[name]


class RewardSet:
    """The reward functions of a run with their weights.

    ``total`` is the weighted sum with None (NaN) counted as 0: a function that does not apply to a
    completion neither rewards nor penalises it (the same as TRL's nansum), and one bad function
    cannot turn every advantage into NaN.
    """

    def __init__(self, names: list[str], weights: list[float] | None = None, base_dir: Path | None = None,
                 extra: Sequence[tuple[str, RewardFn, float]] = ()):
        """Resolve names (built-in, or 'file.py:function' relative to base_dir); weights default to 1.0.
        `extra` adds ready-made functions as (name, function, weight), e.g. the HTTP reward."""
        if not names and not extra:
            raise UserError("no reward functions given (e.g. rewards: [correctness, xmlcount])")
        resolved = [_resolve(n, base_dir) for n in names]
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
    raise UserError(f"reward function {name} failed: {type(exc).__name__}: {_one_line(exc)}") from exc


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
