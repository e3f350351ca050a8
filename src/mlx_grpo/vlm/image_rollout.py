"""Image + text prompts and their rollouts: each prompt built with the model's processor and chat template,
its images encoded once (VisionPolicy.register), prefilled once, and its KV cache repeated for its G samples;
all prompts' samples then decode together (left-padded caches, the padding masked) through the text rollouts'
loop (rollout/loop.decode_rows over a ModelDecoder: the compiled per-row sampler, one key per row and step, end
tokens) and are cut into a Rollout by rollout/loop.finish_rows, as text rollouts are. A row's tokens depend on its key only
(same keys, same rollout; a resumed run samples what the uninterrupted one did; a prompt decoded alone samples
what it does in a batch)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_grpo.base.errors import UserError
from mlx_grpo.data.examples import Example
from mlx_grpo.rollout.loop import ModelDecoder, decode_rows, finish_rows
from mlx_grpo.rollout.rollout_records import Rollout, SamplingParams
from mlx_grpo.vlm.images import image_name, load_image
from mlx_grpo.vlm.policy_model import VisionPolicy


@dataclass
class VisionPrompt:
    """One prompt as the processor made it: ids with the image token repeated per feature, pixels and grids."""

    ids: list[int]
    pixel_values: mx.array
    grid_thw: np.ndarray  # [images, 3]
    images: list[str]  # how logs name its images


def example_images(example: Example, column: str) -> list:
    value = example.columns.get(column)
    if value is None:
        raise UserError(f"an example has no {column!r} column (image_column); its prompt: {str(example.prompt)[:60]!r}")
    return list(value) if isinstance(value, (list, tuple)) else [value]


def encode_vision_prompt(processor, example: Example, column: str, system: str, base_dir: Path | None,
                         max_prompt_length: int) -> VisionPrompt:
    """The example's images before its text in one user turn (after the system prompt), through the template."""
    sources = example_images(example, column)
    images = [load_image(s, base_dir, where=f"{column} {image_name(s)}") for s in sources]
    text = example.prompt if isinstance(example.prompt, str) else example.prompt[-1]["content"]
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]}]
    owner = processor if getattr(processor, "chat_template", None) else processor.tokenizer
    prompt = owner.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out = processor(text=[prompt], images=images, return_tensors="np")
    ids = [int(i) for i in np.asarray(out["input_ids"])[0]]
    if len(ids) > max_prompt_length:  # cutting would cut image tokens from their features
        raise UserError(f"an image prompt has {len(ids)} tokens, more than max_prompt_length = {max_prompt_length}: "
                        "raise max_prompt_length or give smaller images (the processor's max_pixels)")
    return VisionPrompt(ids, mx.array(np.asarray(out["pixel_values"])), np.asarray(out["image_grid_thw"]),
                        [image_name(s) for s in sources])


def vision_rollout(model: VisionPolicy, prompts: list[list[int]], keys: mx.array, G: int, params: SamplingParams,
                   eos_ids: set[int], pad_id: int, tokenizer) -> Rollout:
    """G samples of each registered prompt (ids from VisionPolicy.register); keys [B*G, 2]. Each prompt is
    prefilled alone (its images' features spliced in) and its KV cache repeated for its G samples; the B*G rows
    then decode together, the shorter prompts' caches left-padded and the padding masked out, each row at its
    own multimodal RoPE position."""
    from mlx_vlm.models.cache import KVCache

    T, R = params.max_new_tokens, len(prompts) * G
    caches, first, starts = [], [], []
    for ids in prompts:
        inputs = mx.array([ids], dtype=mx.int32)
        positions = model.positions(inputs)  # [3, 1, L]
        cache = [KVCache() for _ in model.layers]
        first.append(model.head(model.hidden(inputs, positions, cache)[:, -1]))  # [1, V]
        caches.append([(c.keys[..., :c.offset, :], c.values[..., :c.offset, :]) for c in cache])
        starts.append(int(positions.max().item()) + 1)  # the next text position after the prompt
    width = max(len(ids) for ids in prompts)
    cache = [KVCache() for _ in model.layers]
    for layer, c in enumerate(cache):  # [R, heads, width, dim]: each prompt's rows, left-padded to width
        parts = [[mx.pad(mx.repeat(kv[layer][j], G, axis=0), [(0, 0), (0, 0), (width - kv[layer][j].shape[2], 0),
                                                                (0, 0)]) for kv in caches] for j in (0, 1)]
        c.keys, c.values, c.offset = mx.concatenate(parts[0]), mx.concatenate(parts[1]), width
    pad = np.repeat([width - len(ids) for ids in prompts], G)
    mask = mx.array(np.arange(width + T)[None] >= pad[:, None])[:, None, None, :]  # [R, 1, 1, width + T]
    start = mx.array(np.repeat(starts, G), dtype=mx.int32)[None, :, None]  # [1, R, 1]
    logits = mx.repeat(mx.concatenate(first), G, axis=0)  # [R, V]

    def forward(tokens: mx.array, cache: list) -> mx.array:
        """[R, 1] tokens -> [R, 1, V] logits; the token sampled at step t sits at text position start + t."""
        pos = mx.broadcast_to(start + (cache[0].offset - width), (3, R, 1))
        return model.head(model.hidden(tokens.astype(mx.int32), pos, cache, mask)[:, -1])[:, None]

    ends = sorted(eos_ids)
    # a sync every step: the loop stops at the step where the last row ends, as this rollout's own loop did
    # before it was folded into the one loop (tests/test_vision_loop.py), so its columns stay as many
    decoded = decode_rows(ModelDecoder(forward, cache), logits, keys, params, tokenizer, ends, pad_id, sync_every=1)
    return finish_rows(tokenizer, [prompts], G, decoded, ends, pad_id, params, "")[0]
