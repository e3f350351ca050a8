"""Reference solutions: an example's worked solution written as a completion in the run's output format.

The worked examples shown in prompts, the supervised warm start (`sft`) and the demonstrations placed in
a group all need the same thing: the completion a good policy would write for an example, in exactly the
format the run's rewards read. This module owns that conversion. Sources, first found wins:

- a data row's `completion` column: the user's own completion in their format, used verbatim;
- ``Example.solution``: GSM8K's worked solution (examples._row_to_example keeps it) or the one `arith` writes
  in the same form, e.g. "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\\n...\\n#### 72";
- a data row's `solution` column: a worked solution in that form, or plain reasoning text (the answer is
  then the row's `answer`).

The `<<48/2=24>>` calculator annotations are removed (the prose around them already says "48/2 = 24"),
or, in a tool style, turned into calculator calls in the run's syntax (`<calc>48/2</calc>` followed by the
tool's own `<result>24</result>`); the `#### 72` line becomes the answer block, thousands commas dropped.
The reasoning always ends with the answer's number (a sentence "The answer is N." is added when it does
not), as reasoned_format asks. With tools, the rewards read only what the model wrote, not the tool's
output (multiturn.model_texts), so the check is made on the model's own text.

Callers that prefill the start of the completion (e.g. "<reasoning>\\n") take ``after_prefill``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from mlx_grpo.tools.calculator import calculate
from mlx_grpo.tools.calls import ToolFormat

COMPLETION_COLUMN = "completion"
SOLUTION_COLUMN = "solution"
TAGS = ("reasoning", "think")

_ANNOTATION = re.compile(r"<<([^<>]*)>>")
_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)")
_LITERAL = re.compile(r"\$?-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")  # the number GSM8K writes after an annotation
_OPERATOR = re.compile(r"\d\s*[-+*/%]\s*[-(.\d]")
# Spellings of the same expression in prose and in the annotation: "0.2 x 50" == "0.2*50", "$40 – $4" == "40-4".
_PROSE = str.maketrans({"x": "*", "X": "*", "×": "*", "÷": "/", "–": "-", "−": "-"})


@dataclass(frozen=True)
class Style:
    """The output format of a completion. tag: "reasoning" (<reasoning>, the default rewards) or "think"
    (R1, configs/reasoning.toml); tools: the run's tool-call syntax (tools/calls.py) when it has the
    calculator, so that computations become calls; None writes them as prose."""

    tag: str = "reasoning"
    tools: ToolFormat | None = None

    def __post_init__(self):
        if self.tag not in TAGS:
            raise ValueError(f"style tag must be one of {TAGS}, got {self.tag!r}")


@dataclass(frozen=True)
class Segment:
    """A piece of a reference completion: text the model writes ("model"), or a tool's answer ("tool"),
    which the run feeds in and never trains on."""

    text: str
    origin: str = "model"


def style_for(cfg: Any, fmt: ToolFormat | None = None) -> Style:
    """The style a run's rewards expect: <think> when its prefill or system prompt opens that tag (and never
    mentions <reasoning>), calculator calls in `fmt` when the run has the calculator (fmt: its tool format,
    multiturn.MultiTurn.fmt; required then)."""
    think = cfg.data.prefill.lstrip().startswith("<think>") or (
        "<think>" in cfg.data.system_prompt and "<reasoning>" not in cfg.data.system_prompt)
    tools = None
    if "calculator" in cfg.rollout.tools:
        if fmt is None:
            raise ValueError("a run with the calculator needs its tool format to write reference solutions")
        tools = fmt
    return Style("think" if think else "reasoning", tools)


def _clean_answer(answer: str) -> str:
    """The gold answer as the answer block states it: a number without thousands commas, else the text."""
    text = str(answer).strip()
    return text.replace(",", "") if re.fullmatch(r"-?\$?\d[\d,]*(\.\d+)?", text) else text


def _same_value(a: str, b: str) -> bool:
    try:
        return Decimal(a.replace(",", "").replace("$", "")) == Decimal(b.replace(",", "").replace("$", ""))
    except InvalidOperation:
        return False


def _call_text(fmt: ToolFormat, expression: str) -> str:
    """How the model calls the calculator on `expression` in this syntax (tools/calls.py parses these back)."""
    if fmt.name == "plain":
        return f"<calc>{expression}</calc>"
    if fmt.name == "nanochat":
        return f"<|python_start|>{expression}<|python_end|>"
    if fmt.name == "hermes":
        call = {"name": "calculator", "arguments": {"expression": expression}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    raise ValueError(f"no calculator call syntax for tool format {fmt.name!r}")


def _norm(text: str) -> str:
    return re.sub(r"[\s$,]", "", text.translate(_PROSE))


def _written_expression(before: str, expression: str) -> int | None:
    """Where `before` (the text up to an annotation) ends with "<expression> =" as prose writes it, e.g.
    "Weng earns 12/60 = $": the index the expression starts at; None when the prose does not write it."""
    head = before.rstrip(" $")
    if not head.endswith("="):
        return None
    head = head[:-1].rstrip()
    line_start = head.rfind("\n") + 1
    target = _norm(expression)
    for start in range(len(head) - 1, line_start - 1, -1):
        got = _norm(head[start:])
        if got == target and (start == line_start or not head[start - 1].isalnum()):
            return start - 1 if head[start - 1:start] == "$" else start  # "$40 / 10": the sign goes too
        if len(got) > len(target):
            return None
    return None


def _convert_body(body: str, fmt: ToolFormat | None) -> list[Segment]:
    """The reasoning of a worked solution: annotations dropped, or turned into calculator calls where the
    prose writes the expression just before them ("48/2 = <<48/2=24>>24" -> call, result)."""
    segments: list[Segment] = []
    text, pos = "", 0
    for match in _ANNOTATION.finditer(body):
        expression, _, value = match.group(1).partition("=")
        before, after = body[pos:match.start()], match.end()
        start = None
        if fmt is not None and _OPERATOR.search(expression):
            try:
                result = calculate(expression)
            except (ValueError, ArithmeticError, TypeError):
                result = None
            start = _written_expression(text + before, expression) if result is not None else None
        if start is None:  # prose only: the number written after the annotation stays
            text, pos = text + before, after
            continue
        literal = _LITERAL.match(body, after)
        if literal is not None and _same_value(literal.group(0), result):
            after = literal.end()  # the tool's result says it
        segments.append(Segment((text + before)[:start] + _call_text(fmt, expression.strip())))
        segments.append(Segment(fmt.render_result(result), "tool"))
        text, pos = "", after
    segments.append(Segment(text + body[pos:]))
    return segments


def _model_text(segments: list[Segment]) -> str:
    return "".join(s.text for s in segments if s.origin == "model")


def convert_solution(solution: str, answer: str, style: Style = Style()) -> list[Segment]:
    """A worked solution (GSM8K's form, or plain reasoning) as a completion in `style`; answer: the gold
    answer (the "#### N" line, when present, is replaced by it)."""
    body = solution.rpartition("####")[0] if "####" in solution else solution
    segments = _convert_body(body.strip(), style.tools)
    answer = _clean_answer(answer)
    numbers = _NUMBER.findall(_model_text(segments).replace("$", ""))
    if not numbers or not _same_value(numbers[-1].rstrip("."), answer):
        segments.append(Segment(f"\nThe answer is {answer}."))
    segments.insert(0, Segment(f"<{style.tag}>\n"))
    segments.append(Segment(f"\n</{style.tag}>\n<answer>\n{answer}\n</answer>"))
    merged: list[Segment] = []
    for seg in segments:  # adjacent model pieces as one, empty ones dropped
        if merged and seg.origin == merged[-1].origin == "model":
            merged[-1] = Segment(merged[-1].text + seg.text)
        elif seg.text:
            merged.append(seg)
    return merged


def reference_segments(example: Any, style: Style = Style()) -> list[Segment] | None:
    """The example's reference completion in pieces (model text and tool answers, in order), or None when
    it carries no worked solution. example: an examples.Example."""
    columns = getattr(example, "columns", {}) or {}
    completion = columns.get(COMPLETION_COLUMN)
    if isinstance(completion, str) and completion.strip():
        return [Segment(completion)]
    for solution in (getattr(example, "solution", ""), columns.get(SOLUTION_COLUMN)):
        if isinstance(solution, str) and solution.strip():
            return convert_solution(solution, example.answer, style)
    return None


def reference_completion(example: Any, style: Style = Style()) -> str | None:
    """The example's worked solution as one completion in `style`, tool answers included, e.g.
    "<reasoning>\\nNatalia sold 48/2 = 24 clips in May. ...\\n</reasoning>\\n<answer>\\n72\\n</answer>";
    None when the example has no worked solution."""
    segments = reference_segments(example, style)
    return None if segments is None else "".join(s.text for s in segments)


def after_prefill(completion: str, prefill: str) -> str | None:
    """What follows the run's prefill in a completion (the part a model generates after a prefilled prompt);
    None when the completion does not start with the prefill."""
    return completion[len(prefill):] if completion.startswith(prefill) else None


__all__ = ["COMPLETION_COLUMN", "SOLUTION_COLUMN", "Segment", "Style", "after_prefill", "convert_solution",
           "reference_completion", "reference_segments", "style_for"]
