"""How a setting is declared: `setting(default, help, commands, choices=..., range=...)`, once, in its group's
module (model.py, data.py, ...). Validation, the CLI's flags and --help, and docs/config.md all read these
declarations. Also the names a declaration needs: the commands, and defaults other modules share.

This module and the group modules import nothing that loads mlx.core (the CLI picks a BLAS first, blas.py).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import field
from typing import Any

SYSTEM_PROMPT = (
    "\nRespond in the following format:\n\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>\n"
)
DEFAULT_MODEL = "smollm2-135m-instruct"
# Columns searched, in order, for the prompt and the gold answer of a data file or hub data set (sources.py).
PROMPT_COLUMNS = ("prompt", "question", "problem", "query", "instruction", "input")
ANSWER_COLUMNS = ("answer", "solution", "final_answer", "ground_truth", "target", "output", "label")
BUILTIN_REWARD_NAMES = ["correctness", "int", "strict_format", "soft_format", "xmlcount"]
# Built-ins for the R1-style <think>/<answer> format (configs/reasoning.toml), not in the default list.
REASONING_REWARD_NAMES = ["think_format", "think_tags"]
# Rewards that empty reasoning or a made-up answer cannot earn (configs/prod.toml, configs/arith.toml).
REASONED_REWARD_NAMES = ["reasoned_correctness", "reasoned_format"]
# GSM8K's own "#### N" answers (nanochat), and the reward an environment gives (multiturn.py).
EPISODE_REWARD_NAMES = ["hash_answer", "environment_reward"]

# The commands each setting applies to (a setting names them; a preset's keys for other commands are skipped).
INFER = frozenset({"generate", "chat"})
MODEL_CMDS = frozenset({"generate", "chat", "train", "eval", "sft"})
SAMPLING = frozenset({"generate", "chat", "train", "eval"})
TRAIN = frozenset({"train"})
# Training settings that mean the same for `mlx-grpo sft`, the supervised warm start (sft.py).
TUNE = frozenset({"train", "sft"})
DATA = frozenset({"train", "eval", "sft"})
EVAL = frozenset({"eval"})
COMMANDS = ("convert", "generate", "chat", "train", "eval", "sft", "fuse", "plot")

Choices = tuple[Any, ...] | Callable[[], Any]
# '> 0', '>= 1', '<= 8' or an interval '(0, 1]', '[1, 4]'
_RANGE = re.compile(r"^(?:(?P<op>>=|>|<=|<) ?(?P<bound>\S+)"
                    r"|(?P<lo_br>[\[(])(?P<lo>[^,]+), ?(?P<hi>[^\])]+)(?P<hi_br>[\])]))$")


def setting(default: Any, help: str, commands: frozenset[str], *, choices: Choices = (), range: str = "",
            note: str = "", item: str = "value", per_command: Mapping[str, Any] | None = None,
            resume_may_change: bool = False) -> Any:
    """One setting: its default, help text, the commands it applies to, and where it has them its choices
    (a tuple, or a function returning the tuple/dict declared elsewhere, e.g. loss.LOSS_TYPES) and its
    range ('> 0', '>= 1', '(0, 1]', '[1, 4]'; `note` is added to the range error, e.g. '0 = off'). `item`
    names one entry of a list setting with choices in its error ('reporter'). `per_command`: the default
    of the commands whose natural default differs from training's ({"generate": 0.0}). `resume_may_change`:
    a resumed run may set it differently from its checkpoint (it decides what is logged, evaluated, saved or
    how long to wait, never the run's math or data); any other difference is refused (storage/checkpoint.py)."""
    if range:
        parse_range(range)  # a typo in a declaration fails at import, not in a user's run
    if set(per_command or {}) - commands:
        raise ValueError(f"per_command names commands the setting does not apply to: {set(per_command) - commands}")
    metadata = {"help": help, "commands": commands, "choices": choices, "range": range, "note": note,
                "item": item, "per_command": dict(per_command or {}), "resume_may_change": resume_may_change}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def parse_range(text: str) -> tuple[float | None, bool, float | None, bool]:
    """'(0, 1]' -> (low, low_inclusive, high, high_inclusive); a missing end is None."""
    m = _RANGE.match(text)
    if not m:
        raise ValueError(f"range {text!r}: write '> 0', '>= 1', '(0, 1]' or '[1, 4]'")
    if m["op"]:
        bound = float(m["bound"])
        return {">": (bound, False, None, False), ">=": (bound, True, None, False),
                "<": (None, False, bound, False), "<=": (None, False, bound, True)}[m["op"]]
    return float(m["lo"]), m["lo_br"] == "[", float(m["hi"]), m["hi_br"] == "]"


def in_range(value: float, text: str) -> bool:
    low, low_in, high, high_in = parse_range(text)
    return ((low is None or value > low or (low_in and value == low))
            and (high is None or value < high or (high_in and value == high)))


def range_words(f: dataclasses.Field) -> str:
    """The range as an error or a table says it: '>= 1', 'in (0, 1]', '1-4' (a closed integer interval)."""
    text = f.metadata["range"]
    if f.type in ("int", int) and text.startswith("[") and text.endswith("]"):
        low, _, high, _ = parse_range(text)
        return f"{low:g}-{high:g}"
    return f"in {text}" if text[0] in "[(" else text


def choices_of(f: dataclasses.Field) -> tuple[Any, ...]:
    """The setting's choices (resolving a function declared elsewhere, and a dict to its keys)."""
    choices = f.metadata["choices"]
    if callable(choices):
        choices = choices()
    return tuple(choices)


def choice_notes(f: dataclasses.Field) -> Mapping[str, str]:
    """Where the choices are declared as a dict of name -> description (str), that dict; else empty."""
    choices = f.metadata["choices"]
    if callable(choices):
        choices = choices()
    if isinstance(choices, Mapping) and all(isinstance(v, str) for v in choices.values()):
        return choices
    return {}


def default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default
