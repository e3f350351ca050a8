"""The run's prompt: the system prompt with its worked examples (few-shot in the system message).

Owns which training examples are shown as worked examples (`draw_worked_examples`: a seeded draw from the
training split, never an example whose question is in the evaluation set), how each is written (its
question, then its reference completion in the run's format, data/solutions.py), and the one system-prompt text
that training rollouts and evaluation both encode (`RunPrompt`). The measured lever behind the feature: one
worked example in the system prompt took the arith preset from a model that never wrote an <answer> block to
one that does from its first updates (issue 22).

Chat placement (the examples as earlier user/assistant turns) is not offered: only the system-message
placement has been measured.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

import numpy as np

from mlx_grpo.base.errors import UserError
from mlx_grpo.data.examples import Example
from mlx_grpo.data.solutions import Style, reference_completion, reference_segments, style_for
from mlx_grpo.rollout.multiturn import encode_prompts


@dataclass(frozen=True)
class RunPrompt:
    """system: the system prompt the model sees (the configured one, then the examples); examples: the
    rendered worked examples; sources: where each came from ("train #412", "worked_examples_text #1")."""

    system: str
    examples: tuple[str, ...] = ()
    sources: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line for the console and the eval output: which prompt was used."""
        if not self.examples:
            return "the system prompt without worked examples"
        n = len(self.examples)
        return f"the system prompt with {n} worked example{'s' * (n != 1)} ({', '.join(self.sources)})"

    def record(self) -> dict:
        """What an evaluation's output records about its prompt."""
        return {"worked_examples": len(self.examples), "sources": list(self.sources), "system_prompt": self.system}


def question_text(prompt: str | list[dict]) -> str:
    """The question of a prompt: the text, or the last user message of chat messages."""
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m.get("role") == "user"]
    return users[-1] if users else prompt[-1]["content"]


def draw_worked_examples(train: Sequence[Example], k: int, seed: int,
                         exclude: Collection[str] = ()) -> list[int]:
    """Indices of k training examples to show: a seeded permutation of the training split, skipping those
    without a worked solution and those whose question is in `exclude` (the evaluation questions). The same
    split, k, seed and exclusions give the same indices (training and `eval` draw alike)."""
    if k == 0:
        return []
    excluded = {question_text(q).strip() for q in exclude}
    picked = []
    for i in np.random.default_rng(seed).permutation(len(train)).tolist():
        ex = train[i]
        if question_text(ex.prompt).strip() in excluded or reference_segments(ex) is None:
            continue
        picked.append(i)
        if len(picked) == k:
            return picked
    raise UserError(f"worked_examples = {k}, but only {len(picked)} training examples carry a worked solution "
                    "(GSM8K's answer, arith's, or a 'solution'/'completion' column) outside the evaluation set")


@dataclass(frozen=True)
class WorkedExamples:
    """The drawn worked examples and their places in the training split."""

    examples: tuple[Example, ...] = ()
    indices: tuple[int, ...] = ()


def select_worked_examples(cfg, train: Sequence[Example], evals: Sequence[Example], trains: bool = True
                           ) -> tuple[WorkedExamples, list[Example]]:
    """(cfg.data.worked_examples drawn from the training split, the training examples without them): an example
    whose answer is in every prompt would pay for copying it, so it is not trained on. evals: the
    evaluation split, whose questions are never shown (and may not appear in worked_examples_text). trains: the
    caller trains on what is left (train, sft; not eval), so the draw may not leave less than a batch."""
    check_written_examples(cfg.data.worked_examples_text, evals)
    drawn = draw_worked_examples(train, cfg.data.worked_examples, cfg.data.worked_examples_seed,
                                 [e.prompt for e in evals])
    taken = set(drawn)
    left = [ex for i, ex in enumerate(train) if i not in taken]
    batch = cfg.training.batch_size
    if trains and drawn and len(left) < batch <= len(train):  # said here: the sampler's line would not say why
        taken_text = f"all {len(train)}" if not left else f"{len(drawn)} of the {len(train)}"
        raise UserError(f"worked_examples = {len(drawn)} takes {taken_text} training examples into the prompt (an "
                        f"example shown is not trained on), leaving {len(left)} to train on, fewer than batch_size = "
                        f"{batch}: lower worked_examples or add training data")
    return WorkedExamples(tuple(train[i] for i in drawn), tuple(drawn)), left


def render_example(example: Example, style: Style = Style()) -> str:
    """A worked example as the system prompt shows it: the question, then the completion in the run's format
    (with tools, the calls and the results the tool gave)."""
    return f"Example question: {question_text(example.prompt).strip()}\nExample response:\n" \
           f"{reference_completion(example, style)}"


def run_prompt(system_prompt: str, worked: Sequence[Example] = (), texts: Sequence[str] = (),
               style: Style = Style(), indices: Sequence[int] | None = None) -> RunPrompt:
    """The run's system prompt: `system_prompt`, then the drawn worked examples (rendered in `style`), then
    the written ones (`texts`, as is). indices: the drawn examples' places in the training split, for the
    description."""
    blocks = [render_example(ex, style) for ex in worked] + [t.strip("\n") for t in texts]
    sources = [f"train #{i}" for i in (indices if indices is not None else range(len(worked)))]
    sources += [f"worked_examples_text #{i}" for i in range(1, len(texts) + 1)]
    if not blocks:
        return RunPrompt(system_prompt)
    head = system_prompt.rstrip("\n")
    system = "\n\n".join(([head] if head else []) + blocks) + "\n"
    return RunPrompt(system, tuple(blocks), tuple(sources))


def check_written_examples(texts: Sequence[str], eval_examples: Sequence[Example]) -> None:
    """Refuse a written worked example that shows an evaluation question."""
    for i, text in enumerate(texts, 1):
        for ex in eval_examples:
            q = question_text(ex.prompt).strip()
            if q and q in text:
                raise UserError(f"worked_examples_text #{i} shows an evaluation question ({q[:60]!r}...): "
                                "evaluation would score an answer the prompt gives away; write another example")


def check_length(prompt: RunPrompt, bare: RunPrompt, encode, questions: Sequence[str | list[dict]],
                 max_prompt_length: int) -> str:
    """The tokens the examples add and the longest prompt with them, as one line; UserError when that prompt
    would be cut to max_prompt_length (from the left: the examples would be lost). encode(system, question)
    -> ids; questions: the longest few by characters are encoded."""
    longest = sorted(questions, key=lambda q: len(question_text(q)), reverse=True)[:8]
    if not longest or not prompt.examples:
        return ""
    added = len(encode(prompt.system, longest[0])) - len(encode(bare.system, longest[0]))
    most = max(len(encode(prompt.system, q)) for q in longest)
    if most > max_prompt_length:
        raise UserError(f"with {len(prompt.examples)} worked example(s) (+{added} tokens) the longest prompt is "
                        f"{most} tokens, over max_prompt_length = {max_prompt_length}: it would be cut from the "
                        "left, examples first; raise max_prompt_length or show fewer/shorter examples")
    return f"+{added} tokens for the worked examples; longest prompt {most} of max_prompt_length {max_prompt_length}"


def build_run_prompts(cfg, tokenizer, multiturn, worked: WorkedExamples, examples: Sequence[Example],
                      say=print) -> tuple[RunPrompt, RunPrompt]:
    """(the prompt of the run's rollouts, the prompt of its evaluations): cfg.data.system_prompt with the drawn and
    written worked examples in the run's style (its tool syntax: multiturn.fmt); the evaluations' without the
    examples when eval_worked_examples is off. Checks that the longest of `examples` stays within
    max_prompt_length and says (through `say`) which prompts are used and what the examples cost."""
    style = style_for(cfg, multiturn.fmt if multiturn is not None else None)
    bare = RunPrompt(cfg.data.system_prompt)
    prompt = run_prompt(cfg.data.system_prompt, worked.examples, cfg.data.worked_examples_text, style, worked.indices)
    eval_prompt = prompt if cfg.eval.eval_worked_examples else bare
    if prompt.examples:
        uncut = replace(cfg, max_prompt_length=1 << 30)

        def encode(system: str, question) -> list[int]:
            return encode_prompts(multiturn, tokenizer, [Example(question, "")], uncut, system)[0][0]

        cost = check_length(prompt, bare, encode, [e.prompt for e in examples], cfg.data.max_prompt_length)
        say(f"[mlx-grpo] prompt: {prompt.describe()}; {cost}")
    if eval_prompt is not prompt:
        say(f"[mlx-grpo] evaluation prompt: {eval_prompt.describe()} (eval_worked_examples = false)")
    return prompt, eval_prompt


__all__ = ["RunPrompt", "check_length", "check_written_examples", "draw_worked_examples", "question_text",
           "render_example", "run_prompt", "select_worked_examples", "build_run_prompts", "WorkedExamples"]
