"""`mlx-grpo generate --image` and `mlx-grpo chat --image`: image + text prompts through mlx-vlm's
stream_generate, streamed like text generation (commands/inference.py owns the text-only path)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Iterable, TextIO

import mlx.core as mx

from mlx_grpo.base.errors import UserError
from mlx_grpo.commands.inference import chat_inputs
from mlx_grpo.config import Config
from mlx_grpo.models.adapters import adapter_base, attach_saved_adapters, is_adapter_checkpoint, read_adapter_config
from mlx_grpo.vlm.families import is_vision_dir, require_mlx_vlm
from mlx_grpo.vlm.images import load_image


def load_vlm(model_name: str):
    """(model, processor) of an MLX VLM directory converted by `mlx-grpo convert`, or of a checkpoint of a
    GRPO run on images: a full one (its model.safetensors) or a lora/dora one (its base plus the adapters)."""
    require_mlx_vlm()
    if not is_vision_dir(model_name):
        raise UserError(f"model {model_name!r} is not a vision-language model directory: convert one with "
                        "`mlx-grpo convert --hf-path ...`, or leave out --image")
    path = Path(model_name).expanduser()
    if is_adapter_checkpoint(path):
        return _load_with_adapters(path)
    if (path / "trainer_state.json").is_file():  # a full checkpoint: the model without its optimizer state
        with tempfile.TemporaryDirectory(prefix="mlx-grpo-vlm-") as staged:
            for item in path.iterdir():  # mlx-vlm reads every *.safetensors: show it the model's only
                if item.is_file() and (not item.name.endswith(".safetensors") or item.name.startswith("model")):
                    (Path(staged) / item.name).symlink_to(item.resolve())
            return _load(staged, model_name)  # loaded eagerly: the links may go
    return _load(str(path), model_name)


def _load(path: str, model_name: str):
    from mlx_vlm import load

    try:
        return load(path)
    except Exception as exc:
        raise UserError(f"could not load {model_name!r}: {type(exc).__name__}: {exc}") from None


def _load_with_adapters(path: Path):
    """A lora/dora checkpoint of a GRPO run on images: its base, the adapter layers of its config on the
    language model's blocks (where training put them, same parameter names), and its adapter weights."""
    record, kind, num_layers, lora = read_adapter_config(path)
    base = adapter_base(path, record)
    model, processor = load_vlm(base)
    attach_saved_adapters(model, path, base, kind, num_layers, lora)
    model.eval()  # the adapter layers were created in training mode (dropout on)
    mx.eval(model.parameters())
    return model, processor


def image_messages(text: str, n_images: int, system: str = "", history: list[dict] | None = None) -> list[dict]:
    """Chat messages whose last user turn carries n_images images before its text."""
    messages = [{"role": "system", "content": system}] if system else []
    content = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": text}]
    return messages + list(history or []) + [{"role": "user", "content": content}]


def prompt_text(processor, messages: list[dict]) -> str:
    template_owner = processor if getattr(processor, "chat_template", None) else processor.tokenizer
    return template_owner.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def stream_answer(model, processor, text: str, images: list, cfg: Config, on_text=None):
    """Generate one answer; on_text receives each new piece. -> (text, last mlx-vlm GenerationResult)."""
    from mlx_lm.sample_utils import make_logits_processors, make_sampler
    from mlx_vlm import stream_generate

    mx.random.seed(cfg.run.seed)
    r = cfg.rollout
    sampler = make_sampler(temp=r.temperature, top_p=r.top_p if r.top_p < 1 else 0.0, min_p=r.min_p, top_k=r.top_k)
    processors = make_logits_processors(
        repetition_penalty=r.repetition_penalty if r.repetition_penalty != 1.0 else None)
    pieces, last = [], None
    for last in stream_generate(model, processor, text, image=images or None, max_tokens=cfg.rollout.max_new_tokens,
                                sampler=sampler, logits_processors=processors):
        pieces.append(last.text)
        if on_text is not None and last.text:
            on_text(last.text)
    return "".join(pieces), last


def _verbose(last) -> str:
    if last is None:
        return "no tokens generated"
    return (f"prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tokens/s | generation: "
            f"{last.generation_tokens} tokens, {last.generation_tps:.1f} tokens/s | peak memory: "
            f"{last.peak_memory:.3f} GB")


def run_generate_images(cfg: Config, prompt: str, images: list[str], stream: bool = False, verbose: bool = False,
                        out: TextIO | None = None) -> str:
    """One image + text prompt (images read before the model loads, so a bad path fails at once)."""
    out = out or sys.stdout
    if prompt is None:
        raise UserError("--image needs --prompt (--prompts-file takes text prompts only)")
    if prompt == "-":
        prompt = sys.stdin.read()
    pictures = [load_image(path, where=f"--image {path}") for path in images]
    model, processor = load_vlm(cfg.model.model_name)
    text = prompt_text(processor, image_messages(prompt, len(pictures), cfg.data.system_prompt))
    on_text = (lambda t: (out.write(t), out.flush())) if stream else None
    answer, last = stream_answer(model, processor, text, pictures, cfg, on_text)
    out.write(("" if stream else answer) + "\n")
    out.flush()
    if verbose:
        print(_verbose(last), file=sys.stderr)
    return answer


def run_chat_images(cfg: Config, images: list[str], verbose: bool = False, lines: Iterable[str] | None = None,
                    out: TextIO | None = None) -> list[dict]:
    """The chat REPL about images: they go with the first message (and again after /reset)."""
    out = out or sys.stdout
    pictures = [load_image(path, where=f"--image {path}") for path in images]
    model, processor = load_vlm(cfg.model.model_name)
    history: list[dict] = []
    banner = f"mlx-grpo chat ({len(pictures)} image(s)): /reset clears the conversation, /exit quits."
    for message in chat_inputs(lines, out, banner, history):
        n = 0 if history else len(pictures)  # the images belong to the conversation's first turn
        messages = image_messages(message, n, cfg.data.system_prompt, history)
        answer, last = stream_answer(model, processor, prompt_text(processor, messages),
                                     pictures, cfg,
                                     lambda t: (out.write(t), out.flush()))
        out.write("\n")
        if verbose:
            out.write(_verbose(last) + "\n")
        history += [messages[-1], {"role": "assistant", "content": answer}]
    return history
