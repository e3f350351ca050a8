"""Text generation for people: single prompts (plain or streamed), batches from a file, and chat.

Sampling and decoding are mlx-lm's (`stream_generate`, `batch_generate`, `make_sampler`); this module
owns prompt building, the chat REPL and the I/O around them.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, TextIO

import mlx.core as mx

from mlx_grpo.base.errors import UserError
from mlx_grpo.base.interrupt import interrupts_raise
from mlx_grpo.config import Config


@dataclass
class Generation:
    text: str
    prompt_tokens: int
    generation_tokens: int
    prompt_tps: float
    generation_tps: float
    peak_memory_gb: float
    finish_reason: str | None


def chat_messages(prompt: str, system: str = "", history: list[dict] | None = None) -> list[dict]:
    messages = [{"role": "system", "content": system}] if system else []
    return messages + list(history or []) + [{"role": "user", "content": prompt}]


def encode_prompt(tokenizer, prompt: str, system: str = "", raw: bool = False,
                  history: list[dict] | None = None) -> list[int]:
    """Token ids of the prompt: through the chat template unless raw (or the model has none)."""
    if raw or getattr(tokenizer, "chat_template", None) is None:
        return tokenizer.encode(prompt)
    messages = chat_messages(prompt, system, history)
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def _sampling_kwargs(cfg: Config) -> dict:
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    sampler = make_sampler(temp=cfg.rollout.temperature, top_p=cfg.rollout.top_p if cfg.rollout.top_p < 1 else 0.0,
                           min_p=cfg.rollout.min_p, top_k=cfg.rollout.top_k)
    processors = make_logits_processors(
        repetition_penalty=cfg.rollout.repetition_penalty if cfg.rollout.repetition_penalty != 1.0 else None)
    return {"sampler": sampler, "logits_processors": processors}


def generate(model, tokenizer, prompt_ids: list[int], cfg: Config,
             on_text: Callable[[str], None] | None = None) -> Generation:
    """Generate one completion; `on_text` receives each new text segment as it is decoded."""
    from mlx_lm import stream_generate

    # mlx-lm's samplers draw from MLX's global generator: seed it for a reproducible call.
    mx.random.seed(cfg.run.seed)
    pieces: list[str] = []
    last = None
    for last in stream_generate(model, tokenizer, prompt_ids, max_tokens=cfg.rollout.max_new_tokens,
                                **_sampling_kwargs(cfg)):
        pieces.append(last.text)
        if on_text is not None and last.text:
            on_text(last.text)
    if last is None:
        return Generation("", len(prompt_ids), 0, 0.0, 0.0, mx.get_peak_memory() / 1e9, None)
    return Generation("".join(pieces), last.prompt_tokens, last.generation_tokens, last.prompt_tps,
                      last.generation_tps, last.peak_memory, last.finish_reason)


def generate_batch(model, tokenizer, prompts_ids: list[list[int]], cfg: Config,
                   batch_size: int = 32) -> list[str]:
    """Generate for many prompts in batches; results come back in input order."""
    from mlx_lm import batch_generate

    mx.random.seed(cfg.run.seed)
    texts: list[str] = []
    for start in range(0, len(prompts_ids), batch_size):
        chunk = prompts_ids[start:start + batch_size]
        response = batch_generate(model, tokenizer, chunk, max_tokens=cfg.rollout.max_new_tokens,
                                  completion_batch_size=batch_size, prefill_batch_size=min(batch_size, 8),
                                  **_sampling_kwargs(cfg))
        texts.extend(response.texts)
    return texts


def read_prompts_file(path: str | Path) -> list[str]:
    """One prompt per line, or JSONL rows with a 'prompt' field (detected per file)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"prompts file not found: {path}")
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    if not lines:
        raise UserError(f"prompts file {path} has no prompts")
    if not lines[0][1].lstrip().startswith("{"):
        return [line for _, line in lines]
    prompts = []
    for n, line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{n}: invalid JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise UserError(f"{path}:{n}: expected an object with a string 'prompt' field")
        prompts.append(row["prompt"])
    return prompts


def _verbose_line(g: Generation) -> str:
    return (f"prompt: {g.prompt_tokens} tokens, {g.prompt_tps:.1f} tokens/s | generation: "
            f"{g.generation_tokens} tokens, {g.generation_tps:.1f} tokens/s | peak memory: "
            f"{g.peak_memory_gb:.3f} GB")


def run_generate(cfg: Config, prompt: str | None = None, prompts_file: str | None = None,
                 output: str | None = None, batch_size: int = 32, stream: bool = False,
                 raw: bool = False, verbose: bool = False, out: TextIO | None = None) -> None:
    """`mlx-grpo generate`: one prompt (printed, optionally streamed) or a file of prompts (JSONL)."""
    from mlx_grpo.config import save_json
    from mlx_grpo.models import load_model

    out = out or sys.stdout
    if (prompt is None) == (prompts_file is None):
        raise UserError("give exactly one of --prompt or --prompts-file")
    if batch_size < 1:
        raise UserError("--batch-size must be >= 1")
    prompts = read_prompts_file(prompts_file) if prompts_file else None
    if prompt == "-":
        prompt = sys.stdin.read()
    model, tokenizer = load_model(cfg.model.model_name, cfg.model.model_dtype)
    if prompts is None:
        ids = encode_prompt(tokenizer, prompt, cfg.data.system_prompt, raw)
        on_text = (lambda t: (out.write(t), out.flush())) if stream else None
        result = generate(model, tokenizer, ids, cfg, on_text)
        out.write(("" if stream else result.text) + "\n")
        out.flush()
        if verbose:
            print(_verbose_line(result), file=sys.stderr)
        return
    ids = [encode_prompt(tokenizer, p, cfg.data.system_prompt, raw) for p in prompts]
    texts = generate_batch(model, tokenizer, ids, cfg, batch_size)
    rows = [json.dumps({"prompt": p, "completion": t}) for p, t in zip(prompts, texts)]
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text("\n".join(rows) + "\n")
        save_json(cfg, f"{output}.config.json", {"prompts_file": prompts_file, "raw": raw,
                                                  "batch_size": batch_size})
        print(f"wrote {len(rows)} completion{'s' * (len(rows) != 1)} to {output}", file=sys.stderr)
    else:
        out.write("\n".join(rows) + "\n")
    if verbose:
        print(f"peak memory: {mx.get_peak_memory() / 1e9:.3f} GB", file=sys.stderr)


def chat_inputs(lines: Iterable[str] | None, out: TextIO, banner: str, history: list) -> Iterator[str]:
    """The input side of a chat REPL (text or images): `banner`, a `>> ` prompt on a terminal, then each
    non-empty line of `lines` (default stdin); /reset empties `history` in place, /exit or EOF ends."""
    interactive = lines is None and sys.stdin.isatty()
    source = iter(lines) if lines is not None else sys.stdin
    out.write(banner + "\n")
    while True:
        if interactive:
            out.write(">> ")
            out.flush()
        line = next(source, None)
        if line is None:
            return
        message = line.strip()
        if not message:
            continue
        if message == "/exit":
            return
        if message == "/reset":
            history.clear()
            out.write("[conversation cleared]\n")
            continue
        yield message


def run_chat(cfg: Config, verbose: bool = False, lines: Iterable[str] | None = None,
             out: TextIO | None = None) -> list[dict]:
    """`mlx-grpo chat`: a REPL that keeps the conversation; /reset clears it, /exit (or EOF, Ctrl-D) ends it.
    Ctrl-C while an answer is written stops that answer (what was written stays in the conversation, as it was
    shown); Ctrl-C at the prompt ends the chat.

    Works from a pipe: lines are read from `lines` (default stdin) and answers streamed to `out`.
    Returns the final history (useful to callers and tests).
    """
    from mlx_grpo.models import load_model

    out = out or sys.stdout
    model, tokenizer = load_model(cfg.model.model_name, cfg.model.model_dtype)
    history: list[dict] = []
    inputs = chat_inputs(lines, out, "mlx-grpo chat: /reset clears the conversation, /exit (or Ctrl-D) quits, "
                                     "Ctrl-C stops an answer.", history)
    with interrupts_raise():
        while True:
            try:
                message = next(inputs, None)
            except KeyboardInterrupt:  # at the prompt: the chat ends, as at EOF
                out.write("\n")
                break
            if message is None:
                break
            shown: list[str] = []
            try:
                ids = encode_prompt(tokenizer, message, cfg.data.system_prompt, history=history)
                result = generate(model, tokenizer, ids, cfg, lambda t: (shown.append(t), out.write(t), out.flush()))
                answer = result.text
                out.write("\n")
                if verbose:
                    out.write(_verbose_line(result) + "\n")
            except KeyboardInterrupt:  # this answer only: back to the prompt
                answer = "".join(shown)
                out.write("\n[answer stopped]\n")
            out.flush()
            history += [{"role": "user", "content": message}, {"role": "assistant", "content": answer}]
    return history
