"""The data of `mlx-grpo sft`: token rows whose loss covers the completion only.

Three sources, each tokenized as `train` sees it:
- the run's data set (`gsm8k`, `arith`, or a GSM8K-form / prompt-answer file): every example's prompt is
  encoded exactly as `train` encodes it (system prompt with its worked examples, data/prompts.py; chat template,
  prefill, tools; multiturn.encode_prompts)
  and the target is its worked solution written in the run's answer format (solutions.reference_segments),
  the part after the prefill; with the calculator its computations are calls and the tool's answers context;
- a file of prompt + completion rows: the prompt as above, the completion as the target;
- a file of chat `messages` rows: every assistant turn is a target, the other turns are context.
A target is followed by the end-of-turn token (the tokenizer's eos), so the model learns where its answer
ends, as rollouts end. Each row becomes an `SFTRow`: prompt ids, then the ids after them with a mask of the
trained ones (1) and of context (0: a later user turn of a conversation, a tool's answer).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mlx_grpo.base.errors import UserError
from mlx_grpo.data.examples import Example, subset
from mlx_grpo.data.prompts import RunPrompt, build_run_prompts, select_worked_examples
from mlx_grpo.data.solutions import Segment, after_prefill, reference_segments, style_for
from mlx_grpo.data.sources import run_examples
from mlx_grpo.rollout.multiturn import MultiTurn, encode_prompts


@dataclass(frozen=True)
class SFTRow:
    """One training sequence: prompt_ids (context, never trained), then ids with mask 1 where trained."""

    prompt_ids: list[int]
    ids: list[int]
    mask: list[int]

    @property
    def trained(self) -> int:
        return sum(self.mask)


def end_id(tokenizer) -> int:
    """The token a target ends with: the tokenizer's eos (the chat template's end of turn)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = sorted(tokenizer.eos_token_ids)[0]
    return int(eos)


def target_ids(tokenizer, text: str) -> list[int]:
    """A target's ids as the model samples them after its prompt: no special tokens added, then the eos."""
    return list(tokenizer.encode(text, add_special_tokens=False)) + [end_id(tokenizer)]


def strip_prefill(text: str, prefill: str, where: str) -> str:
    """A user's completion as a rollout samples it: without a leading prefill (rollouts start after it); one
    that does not start with the prefill is taken as what follows it."""
    if prefill and text.startswith(prefill):
        text = text[len(prefill):]
    if not text.strip():
        raise UserError(f"{where}: the completion is empty" + (" after the prefill" if prefill else ""))
    return text


def prompt_rows(examples: list[Example], completions: list[str], tokenizer, cfg, multiturn: MultiTurn | None,
                system: str) -> tuple[list[SFTRow], int]:
    """Rows of (example, its completion after the prefill); prompts encoded as `train` encodes them, with the
    run's system prompt `system` (prompts.RunPrompt). -> (rows, prompts cut to max_prompt_length)."""
    encoded = encode_prompts(multiturn, tokenizer, examples, cfg, system)
    rows = []
    for (ids, _), text in zip(encoded, completions):
        target = target_ids(tokenizer, text)
        rows.append(SFTRow(list(ids), target, [1] * len(target)))
    return rows, sum(cut for _, cut in encoded)


def conversation_row(messages: list[dict], tokenizer, cfg, where: str, system: str) -> tuple[SFTRow, bool]:
    """A chat conversation through the chat template: each assistant turn (through its end-of-turn token) is
    trained, everything else is context. The run's system prompt `system` is added as `train` adds it: when
    the conversation has none. -> (row, whether the context before the first answer was cut)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise UserError(f"{where}: chat `messages` need a tokenizer with a chat template; this model has none "
                        "(write prompt + completion rows instead)")
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: the conversation has no assistant message to train on")
    if system and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": system}, *messages]
    eos = end_id(tokenizer)
    ids, mask, done = [], [], ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if not message["content"].strip():
            raise UserError(f"{where}: assistant message {i} is empty")
        before = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=False)
        through = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)
        if not (before.startswith(done) and through.startswith(before)):
            raise UserError(f"{where}: this model's chat template does not render the conversation turn by turn "
                            "(an earlier turn changes when a later one is added), so its assistant turns cannot be "
                            "told apart; write prompt + completion rows instead")
        context = list(tokenizer.encode(before[len(done):], add_special_tokens=False))
        answer = list(tokenizer.encode(through[len(before):], add_special_tokens=False))
        # trained through the end-of-turn token; what the template writes after it (a newline) is context
        end = answer.index(eos) + 1 if eos in answer else len(answer)
        ids += context + answer
        mask += [0] * len(context) + [1] * end + [0] * (len(answer) - end)
        done = through
    first = mask.index(1)
    prompt, cut = ids[:first], False
    if len(prompt) > cfg.data.max_prompt_length:  # as prompts are cut: from the left
        prompt, cut = prompt[-cfg.data.max_prompt_length:], True
    return SFTRow(prompt, ids[first:], mask[first:]), cut


def _messages(value, where: str, key: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise UserError(f"{where}: '{key}' must be a non-empty list of {{'role', 'content'}} messages")
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise UserError(f"{where}: {key} message {i} must be {{'role': str, 'content': str}}, got {m!r}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def read_rows(path: Path) -> list[tuple[str, dict]]:
    """(`file:line`, row) of a JSON-lines file of prompt/completion or messages rows."""
    if not path.is_file():
        raise UserError(f"data file not found: {path}")
    if path.suffix.lower() not in (".jsonl", ".json"):
        raise UserError(f"{path}: sft reads prompt/completion or messages rows from .jsonl files")
    out = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{lineno}: invalid JSON ({e.msg}, column {e.colno}); expected one JSON "
                                "object per line") from None
            if not isinstance(row, dict):
                raise UserError(f"{path}:{lineno}: expected a JSON object per row, got {type(row).__name__}")
            out.append((f"{path}:{lineno}", row))
    if not out:
        raise UserError(f"{path}: the data set is empty (no rows)")
    return out


def file_rows(path: Path, tokenizer, cfg, multiturn: MultiTurn | None, system: str) -> tuple[list[SFTRow], int]:
    """The rows of a prompt/completion or messages file (max_train_samples of them: a seeded subset)."""
    raw = read_rows(path)
    if cfg.data.max_train_samples:
        raw = subset(raw, cfg.data.max_train_samples, cfg.run.seed)
    rows, cut, pending = [], 0, []  # pending: (index, Example, completion) encoded together below
    for where, row in raw:
        if "messages" in row:
            if multiturn is not None:
                raise UserError(f"{where}: chat `messages` rows and tools/environment do not mix: the tools' "
                                "prompt would differ from the conversation's; use prompt + completion rows")
            made, was_cut = conversation_row(_messages(row["messages"], where, "messages"), tokenizer, cfg, where,
                                             system)
            rows.append(made)
            cut += was_cut
            continue
        missing = [k for k in ("prompt", "completion") if k not in row]
        if missing:
            raise UserError(f"{where}: row is missing {' and '.join(repr(k) for k in missing)}: sft rows hold "
                            f"'prompt' and 'completion', or 'messages' (keys: {', '.join(row) or 'none'})")
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, list):
            prompt = _messages(prompt, where, "prompt")
        elif not isinstance(prompt, str) or not prompt.strip():
            raise UserError(f"{where}: 'prompt' must be non-empty text or a list of messages")
        if not isinstance(completion, str):
            raise UserError(f"{where}: 'completion' must be text, got {completion!r}")
        example = Example(prompt=prompt, answer=str(row.get("answer", "")),
                          columns={k: v for k, v in row.items() if k not in ("prompt", "completion", "answer")})
        pending.append((len(rows), example, strip_prefill(completion, cfg.data.prefill, where)))
        rows.append(None)
    if pending:
        made, n_cut = prompt_rows([e for _, e, _ in pending], [c for _, _, c in pending], tokenizer, cfg, multiturn,
                                  system)
        for (i, _, _), r in zip(pending, made):
            rows[i] = r
        cut += n_cut
    return rows, cut


def is_sft_file(path: Path) -> bool:
    """Whether a data file holds sft rows (prompt + completion, or messages) rather than question/answer rows
    (judged by its first row)."""
    if path.suffix.lower() not in (".jsonl", ".json") or not path.is_file():
        return False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    return True  # read_rows names the line
                # question/answer rows (GSM8K form, prompt + answer) have an answer; anything else is read as
                # sft rows, whose errors name what sft needs
                return not isinstance(row, dict) or "messages" in row or "completion" in row or "answer" not in row
    return True


def reference_rows(examples: list[Example], tokenizer, cfg, multiturn: MultiTurn | None,
                   system: str) -> tuple[list[SFTRow], int]:
    """Rows of question/answer examples whose target is their worked solution in the run's answer format
    (data/solutions.py): the model's text is trained; with the calculator, the tool's answers between its calls
    are context, as multi-turn rollouts feed them. Examples without a worked solution are left out."""
    style = style_for(cfg, multiturn.fmt if multiturn is not None else None)
    pieces = [reference_segments(e, style) for e in examples]
    kept = [i for i, p in enumerate(pieces) if p is not None]
    if not kept:
        raise UserError("no training example has a worked solution to learn from (GSM8K's solutions, arith's, or "
                        "a 'solution' column): give sft a dataset_path of prompt + completion or messages rows")
    if len(kept) < len(examples):
        print(f"[mlx-grpo] sft: no worked solution in {len(examples) - len(kept)} of the {len(examples)} examples: "
              "left out", flush=True)
    encoded = encode_prompts(multiturn, tokenizer, [examples[i] for i in kept], cfg, system)
    rows = []
    for i, (prompt, _) in zip(kept, encoded):
        first, *rest = pieces[i]
        text = after_prefill(first.text, cfg.data.prefill) if first.origin == "model" else None
        if text is None:
            raise UserError(f"the worked solutions are written as {first.text[:20]!r}... but prefill = "
                            f"{cfg.data.prefill!r} does not open them: set the prefill the format starts with")
        ids, mask = [], []
        for seg in [Segment(text), *rest]:
            seg_ids = list(tokenizer.encode(seg.text, add_special_tokens=False))
            ids += seg_ids
            mask += [int(seg.origin == "model")] * len(seg_ids)
        if not any(mask):
            raise UserError(f"example {i}: its worked solution is empty after the prefill {cfg.data.prefill!r}")
        rows.append(SFTRow(list(prompt), ids + [end_id(tokenizer)], mask + [1]))
    return rows, sum(cut for _, cut in encoded)


@dataclass
class SFTData:
    """What an sft run trains and evaluates on, with the prompts `train` would use for the same config."""

    rows: list[SFTRow]
    cut: int  # prompts cut to max_prompt_length
    evals: list[Example] | None  # the fixed eval subset (eval_every_updates), else None
    prompt: RunPrompt  # the system prompt of the training rows, worked examples included
    eval_prompt: RunPrompt


def load_sft_data(cfg, tokenizer, multiturn: MultiTurn | None, say=print) -> SFTData:
    """The rows of an sft run (max_train_samples of them, a seeded subset as `train` takes), its eval subset
    and its prompts. Worked examples are drawn as `train` draws them (data/prompts.py: from the whole training
    split, never an eval question) and their examples are left out of the rows, as `train` leaves them out."""
    path = Path(cfg.data.dataset_path).expanduser() if cfg.data.dataset_path else None
    evals = None
    if cfg.eval.eval_every_updates or cfg.data.worked_examples or cfg.data.worked_examples_text:
        evals = run_examples(cfg, "test")
    if path is not None and is_sft_file(path):
        if cfg.data.worked_examples:
            raise UserError(f"worked_examples draws from question/answer data, and {path} holds sft rows: write the "
                            "examples out in worked_examples_text instead")
        worked, _ = select_worked_examples(cfg, [], evals or [])
        prompt, eval_prompt = build_run_prompts(cfg, tokenizer, multiturn, worked, evals or [], say)
        rows, cut = file_rows(path, tokenizer, cfg, multiturn, prompt.system)
    else:
        examples = run_examples(cfg, "train")
        worked, examples = select_worked_examples(cfg, examples, evals or [])
        if cfg.data.max_train_samples:
            examples = subset(examples, cfg.data.max_train_samples, cfg.run.seed)
        prompt, eval_prompt = build_run_prompts(cfg, tokenizer, multiturn, worked, examples + (evals or []), say)
        rows, cut = reference_rows(examples, tokenizer, cfg, multiturn, prompt.system)
    evals = subset(evals, cfg.eval.eval_subset_size, cfg.run.seed) if cfg.eval.eval_every_updates else None
    return SFTData(rows, cut, evals, prompt, eval_prompt)


__all__ = ["SFTData", "SFTRow", "conversation_row", "end_id", "file_rows", "is_sft_file", "load_sft_data",
           "prompt_rows", "read_rows", "reference_rows", "strip_prefill", "target_ids"]
