"""The built-in reward functions and the answer/format parsers they share (evaluation's answer check too).
loading.py resolves reward names (these, or a user's ``path/file.py:function``); scoring.py runs them.

Every reward has the TRL-like signature
``fn(prompts, completions, completion_ids, **columns) -> list[float | None]``;
``None`` means "not applicable to this completion".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import Any


from mlx_grpo.base.errors import UserError
from mlx_grpo.config import SYSTEM_PROMPT  # noqa: F401  (re-exported: the prompt the format rewards expect)

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


def completion_text(completion: Any) -> str:
    """Completions are texts; tolerate TRL's conversational form (a list of messages) by taking the last one."""
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


# ---------------------------------------------------------------- built-in rewards


def correctness(prompts, completions, completion_ids, answer=None, **columns) -> list[float]:
    """2.0 when the extracted answer equals the gold ``answer`` column, else 0.0."""
    if answer is None:
        raise ValueError("needs an 'answer' column with the gold answers")
    return [2.0 if answers_match(extract_answer(completion_text(c)), a) else 0.0 for c, a in zip(completions, answer)]


def int_reward(prompts, completions, completion_ids, **columns) -> list[float]:
    """0.5 when the extracted answer is an integer ("-12", "1,000", "$5"), else 0.0."""
    out = []
    for c in completions:
        pred = extract_answer(completion_text(c))
        out.append(0.5 if pred is not None and _INTEGER.fullmatch(_normalize_number(pred)) else 0.0)
    return out


def strict_format(prompts, completions, completion_ids, **columns) -> list[float]:
    """0.5 when the whole completion is exactly the reasoning/answer layout, newlines included."""
    return [0.5 if _STRICT.match(completion_text(c)) else 0.0 for c in completions]


def soft_format(prompts, completions, completion_ids, **columns) -> list[float]:
    """0.5 when a reasoning block followed by an answer block appears anywhere."""
    return [0.5 if _SOFT.search(completion_text(c)) else 0.0 for c in completions]


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
    return [xmlcount_score(completion_text(c)) for c in completions]


def think_format(prompts, completions, completion_ids, **columns) -> list[float]:
    """0.5 when the completion is a <think> block then an <answer> block (a blank line between them
    allowed), each tag on its own line; else 0.0."""
    return [0.5 if _THINK.match(t) or _THINK_SPACED.match(t) else 0.0 for t in map(completion_text, completions)]


def think_tags(prompts, completions, completion_ids, **columns) -> list[float]:
    """0.25 for each of <think>, </think>, <answer>, </answer> present exactly once (up to 1.0)."""
    return [sum(0.25 for tag in _THINK_TAGS if t.count(tag) == 1) for t in map(completion_text, completions)]


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
    given = {n.lstrip("+") for n in _numbers(completion_text(prompt))}
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
            for p, t, a in zip(prompts, map(completion_text, completions), answer)]


def reasoned_format(prompts, completions, completion_ids, transcripts=None, **columns) -> list[float]:
    """Format credit that empty reasoning or a made-up answer cannot earn, up to 0.5: nothing unless the
    reasoning is substantive; then 0.125 for each of <reasoning> and </reasoning> present once, and 0.125
    for each of <answer> and </answer> present once when the answer is the reasoning's last number;
    minus 0.001 per character after </answer> (as xmlcount), never below 0."""
    out = []
    episodes = transcripts if transcripts is not None else [None] * len(prompts)
    for prompt, text, transcript in zip(prompts, map(completion_text, completions), episodes):
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
        found = _HASH_ANSWER.findall(completion_text(c))
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


# ---------------------------------------------------------------- reward set


