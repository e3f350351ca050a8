"""Decoding on the model itself: B prompts x G sampled completions in one batched KV-cache decode
(generate_rollout: the prefill and caches here, then the one decode loop, loop.decode_rows, over a
loop.ModelDecoder), prompt encoding, and the memory a rollout needs. The engine (engine.py) samples on a
fused sampling copy of the model (models/decoder.py) where it can, and with generate_rollout elsewhere.

Each prompt is prefilled once; its cache is then repeated for its G samples. Sampling draws from
softmax(logits / temperature) (optionally cut by top-k / top-p / min-p) with one random key per row,
so a row's tokens depend on its key only, not on which other rows share the batch: the same keys give
the same rollout, and ranks of a data-parallel run sampling their shares of a batch reproduce what one
process would sample for the whole batch. The record keeps the exact sampled ids: the loss never
re-encodes text.

Where the CUDA decode-attention kernel (kernels/attention.py) serves the model, decoding runs on a
fixed-capacity KV cache (StaticBatchCache) written in place, and the kernel skips each row's left padding
itself: MLX's fused CUDA decode kernel takes no mask, and the masked fallback costs ~6 extra ops per layer per
step. The model's decode step is then models/kernel_forward.decode_step (the model's forward on its own
modules, attention through StaticBatchCache.attend): mlx-lm's attention cannot be pointed at the kernel
without swapping its module's global, which that module's docstring explains.
Elsewhere (other backends and model families) rows decode on the batch versions of the caches the model
asks for (`model.make_cache()`, batch_caches): growing BatchKVCache for full attention, window-sized
BatchRotatingKVCache for sliding-window layers, ArraysCache for recurrent layers (gated delta, short
convolutions, Mamba), none for the KV-shared layers of Gemma 4. Each is told the rows' left padding, so a
pad token never enters an attention score or a recurrent state.
"""

from __future__ import annotations

import os
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import (ArraysCache, BatchKVCache, BatchRotatingKVCache, CacheList, KVCache,
                                  RotatingKVCache)

from mlx_grpo.base.errors import UserError
from mlx_grpo.kernels.attention import left_padded_attention
from mlx_grpo.models.kernel_forward import decode_step, serves as kernel_serves
from mlx_grpo.models.forward import bucket
from mlx_grpo.rollout.loop import ModelDecoder, decode_rows, finish_rows
from mlx_grpo.rollout.rollout_records import Rollout, SamplingParams
from mlx_grpo.rollout.sampler import end_ids


def encode_chat_prompt(tokenizer, prompt: str | list[dict], system_prompt: str, prefill: str,
                       max_prompt_length: int) -> tuple[list[int], bool]:
    """Template the prompt (system + user, or given messages), append the prefill, and keep at most
    max_prompt_length tokens from the right (the generation prompt and prefill survive). -> (ids, cut)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt and not any(m.get("role") == "system" for m in messages):
        messages = [{"role": "system", "content": system_prompt}] + messages
    if getattr(tokenizer, "chat_template", None) is not None:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text + prefill, add_special_tokens=False)
    else:
        ids = tokenizer.encode("\n\n".join(m["content"] for m in messages) + "\n" + prefill)
    ids = list(ids)
    if len(ids) > max_prompt_length:
        return ids[-max_prompt_length:], True
    return ids, False


def _prompt_caches(model: nn.Module) -> list:
    """The model's own per-layer caches for one sequence (mlx-lm's make_cache; plain KV caches without
    it). Gemma 4's KV-shared layers have none: the model reads earlier layers' keys and values."""
    return model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]


def _batch_cache(cache, padding: list[int]):
    """The batched version of one layer's cache for rows left-padded by `padding`."""
    if type(cache) is KVCache:
        return BatchKVCache(padding)
    if type(cache) is RotatingKVCache:  # sliding window: the cache stays window-sized
        if cache.keep:
            raise UserError(f"a rotating KV cache that keeps its first {cache.keep} tokens has no batched "
                            "version in mlx-lm; this model cannot be sampled in batches")
        return BatchRotatingKVCache(cache.max_size, padding)
    if isinstance(cache, ArraysCache):  # recurrent state: padded positions are masked out of it
        return ArraysCache(len(cache.cache), left_padding=padding)
    if isinstance(cache, CacheList):
        return CacheList(*(_batch_cache(c, padding) for c in cache.caches))
    raise UserError(f"the rollout decode does not know the cache type {type(cache).__name__} that this "
                    "model asks for (quantized or chunked KV caches have no batched version)")


def check_batch_caches(model: nn.Module) -> None:
    """Raise UserError, naming the family, when the model asks for a cache the decode cannot batch."""
    try:
        [_batch_cache(c, [0]) for c in _prompt_caches(model)]
    except UserError as err:
        raise UserError(f"model family {getattr(model, 'model_type', type(model).__name__)!r}: {err}") from None


def batch_caches(model: nn.Module, padding: list[int]) -> list:
    """Per-layer batch caches for rows left-padded by `padding` (one per cache make_cache returns)."""
    return [_batch_cache(c, padding) for c in _prompt_caches(model)]


def _prefill(model: nn.Module, prompts: list[list[int]], pad_id: int) -> tuple[mx.array, list]:
    """Left-pad the B prompts and run them once; -> (last logits [B, V], per-layer caches)."""
    width = bucket(max(len(p) for p in prompts))  # extra left padding: fewer distinct shapes
    padding = [width - len(p) for p in prompts]
    tokens = mx.array([[pad_id] * pad + p for pad, p in zip(padding, prompts)], dtype=mx.int32)  # [B, Lp]
    caches = batch_caches(model, padding)
    logits = model(tokens, cache=caches)[:, -1, :]  # [B, V]
    for cache in _leaves(caches):
        if isinstance(cache, ArraysCache):
            # The padding is behind the state now; left in place, models that never advance the cache
            # (gated delta) would mask every later token of a padded row.
            cache.left_padding = cache.lengths = None
    return logits, caches


def _leaves(caches: list) -> list:
    out = []
    for cache in caches:
        out.extend(_leaves(cache.caches) if isinstance(cache, CacheList) else [cache])
    return out


def _repeat_caches(caches: list, group_size: int) -> None:
    """Share each prompt's prefilled cache with its G samples: [B, ...] -> [B*G, ...] in place."""
    def rep(a):
        return None if a is None else mx.repeat(a, group_size, axis=0)

    for cache in _leaves(caches):
        if isinstance(cache, ArraysCache):
            cache.cache = [rep(a) for a in cache.cache]
        else:  # BatchKVCache, BatchRotatingKVCache
            cache.keys, cache.values = rep(cache.keys), rep(cache.values)
            cache.offset, cache.left_padding = rep(cache.offset), rep(cache.left_padding)


class StepArrays:
    """Per-step arrays every layer's cache needs, built once per step instead of once per layer."""

    def __init__(self, left_padding: mx.array, capacity: int):
        self.left_padding = left_padding.astype(mx.int32)  # [N]
        self.sizes = mx.array([left_padding.shape[0], capacity], dtype=mx.int32)  # rows, slots
        self._idx = None
        self.offset = self.stop = None

    def at(self, idx: int) -> "StepArrays":
        if idx != self._idx:
            self._idx = idx
            self.offset = idx - self.left_padding  # [N] RoPE position of the token written at idx
            self.stop = mx.array([idx + 1], dtype=mx.int32)  # attend to slots < idx + 1
        return self


class StaticBatchCache:
    """One layer's KV cache with a fixed capacity: buffers [N, H, S, D] written in place at `idx`.

    Row r holds `left_padding[r]` pad slots, then its prompt, then its completion; slots before
    left_padding[r] and from idx on are never attended. Implements the cache interface of mlx-lm's
    attention layers, plus `attend`: the attention models/kernel_forward.decode_step runs.
    """

    # use_kernel must only be set when the decode step is kernel_forward.decode_step: make_mask then returns
    # None and only `attend` knows which slots to skip (mlx-lm's own attention would attend to the padding).
    def __init__(self, keys: mx.array, values: mx.array, step: StepArrays, idx: int, use_kernel: bool):
        self.keys, self.values = keys, values  # [N, H, S, D]
        self.step = step  # shared by all layers
        self.idx = idx  # next slot to write
        self.use_kernel = use_kernel

    @property
    def left_padding(self) -> mx.array:
        return self.step.left_padding

    @property
    def offset(self) -> mx.array:
        """RoPE position of the next token, per row: [N]."""
        return self.step.at(self.idx).offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n = keys.shape[2]
        self.keys[..., self.idx:self.idx + n, :] = keys
        self.values[..., self.idx:self.idx + n, :] = values
        self.idx += n
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, **kwargs) -> mx.array | None:
        if self.use_kernel and N == 1:
            return None  # the kernel reads left_padding and idx itself
        positions = mx.arange(self.keys.shape[2])  # [S]
        queries = self.idx + mx.arange(N)  # [N_q]
        visible = positions[None, :] <= queries[:, None]  # [N_q, S]: causal, hides the empty tail
        return visible[None, None] & (positions >= self.left_padding[:, None, None, None])  # [N, 1, N_q, S]

    def attend(self, queries, keys, values, scale: float, mask) -> mx.array:
        if self.use_kernel and queries.shape[2] == 1:
            # update_and_fetch already advanced idx past the new token
            return left_padded_attention(queries, keys, values, scale, self.left_padding,
                                         self.step.at(self.idx - 1).stop, self.step.sizes)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def supports_static_cache(model: nn.Module) -> bool:
    """True when every layer uses a plain KV cache (no sliding window or recurrent state)."""
    return all(type(c) is KVCache for c in _prompt_caches(model))


def _static_caches(caches: list, group_size: int, capacity: int, use_kernel: bool) -> list[StaticBatchCache]:
    """Copy the B prefilled caches into [B*G, H, capacity, D] buffers, one per layer."""
    step = StepArrays(mx.repeat(caches[0].left_padding, group_size, axis=0), capacity)  # [N]
    out = []
    for cache in caches:
        k, v = cache.keys[..., :cache._idx, :], cache.values[..., :cache._idx, :]  # [B, H, Lp, D]
        tail = [(0, 0), (0, 0), (0, capacity - k.shape[2]), (0, 0)]
        out.append(StaticBatchCache(mx.repeat(mx.pad(k, tail), group_size, axis=0),
                                    mx.repeat(mx.pad(v, tail), group_size, axis=0), step, cache._idx, use_kernel))
    mx.eval([(c.keys, c.values) for c in out])
    return out


def generate_rollout(model: nn.Module, tokenizer, prompts: list[list[int]], group_size: int,
                     params: SamplingParams, key: mx.array, prefill_text: str = "",
                     sync_every: int = 8, static_cache: bool | None = None,
                     attention_kernel: bool = True, on_stop=None, limits: np.ndarray | None = None,
                     on_done=None, closing: np.ndarray | None = None) -> Rollout:
    """Sample G completions for each of the B prompts; decoding stops once every row has ended. key is
    one key (split into the N = B*G row keys) or the row keys themselves, [N, 2].

    By default (static_cache=None) rows decode on the fixed-capacity cache with our CUDA kernel where it
    serves the model, else on mlx-lm's growing BatchKVCache (faster than masked attention over a fixed
    buffer). static_cache=True/False and attention_kernel=False force a path (tests, benchmarks).
    on_stop(row, ids): called at the loop's stop-string checks with each row seen stopped and its ids up
    to the stop (multiturn.py starts the row's tool call then). limits [N]: a row counts as done after
    that many tokens (the loop ends sooner; the caller cuts the row there). on_done(done): called at the
    loop's syncs with [N] bool, the rows ended so far (evaluation's progress bar). closing: sampler.closing_tokens'
    table for params.stop (the engine's), so that the stop checks decode only rows that can have stopped."""
    eos_ids, pad_id = end_ids(tokenizer, params)
    logits, caches = _prefill(model, prompts, pad_id)
    logits = mx.repeat(logits, group_size, axis=0)  # [N, V]
    row_keys = key if key.ndim == 2 else mx.random.split(key, logits.shape[0])  # [N, 2]
    plain_caches = supports_static_cache(model)
    kernel = plain_caches and attention_kernel and kernel_serves(model, caches[0].keys.shape[-1])
    static = plain_caches and (kernel if static_cache is None else static_cache)
    use_kernel = static and kernel
    if static:
        caches = _static_caches(caches, group_size, caches[0]._idx + params.max_new_tokens, use_kernel)
    else:
        _repeat_caches(caches, group_size)
    forward = partial(decode_step, model) if use_kernel else model
    decoded = decode_rows(ModelDecoder(forward, caches), logits, row_keys, params, tokenizer, eos_ids, pad_id,
                          sync_every, limits=limits, on_stop=on_stop, on_done=on_done, closing=closing)
    return finish_rows(tokenizer, [prompts], group_size, decoded, eos_ids, pad_id, params, prefill_text)[0]


def rollout_memory_bytes(model: nn.Module, rows: int, length: int, kv_copies: float = 1.0) -> int | None:
    """Bytes a rollout of `rows` rows of up to `length` tokens needs at least: its KV caches (the keys and
    values of the layers that keep them, in the compute dtype; a sliding-window layer keeps its window, a
    recurrent or KV-shared layer none), kv_copies of them alive at once (copy_decoder.cache_copies), plus the
    float32 logits of one decode step, three times over (softmax, sampling). None for a model whose shape the
    config does not give."""
    args = getattr(model, "args", None)
    text = getattr(args, "text_config", None)  # a wrapped language model's (qwen3_5) settings
    arg = text.get if isinstance(text, dict) else (lambda name: getattr(args, name, None))
    layers, heads, hidden, vocab = (arg(k) for k in ("num_hidden_layers", "num_attention_heads", "hidden_size",
                                                     "vocab_size"))
    if not all(isinstance(v, int) and v > 0 for v in (layers, heads, hidden, vocab)):
        return None
    kv_heads = arg("num_key_value_heads") or heads
    head_dim = arg("head_dim") or hidden // heads
    itemsize = model.model.embed_tokens.weight.dtype.size if hasattr(model, "model") else 2
    tokens = sum(length if type(c) is KVCache else min(length, c.max_size) if type(c) is RotatingKVCache else 0
                 for c in _leaves(_prompt_caches(model)))
    return int(kv_copies * rows * tokens * 2 * kv_heads * head_dim * itemsize) + 3 * rows * vocab * 4


def machine_memory_bytes() -> int | None:
    """The accelerator's memory (Metal, CUDA) or, on a CPU, the machine's RAM; None when unknown."""
    size = mx.device_info().get("memory_size")
    if size:
        return int(size)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
