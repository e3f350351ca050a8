"""Rollouts: B prompts x G sampled completions in one batched KV-cache decode, as a typed record.

Each prompt is prefilled once; its cache is then repeated for its G samples. Sampling draws from
softmax(logits / temperature) (optionally cut by top-k / top-p / min-p) with keys passed in, so the
same key gives the same rollout. The record keeps the exact sampled ids: the loss never re-encodes text.

Decoding runs on a fixed-capacity KV cache (StaticBatchCache) so every step has the same shapes and
the whole step (model + sampling + EOS bookkeeping) is one mx.compile'd function: per-step launch
overhead, not FLOPs, dominates small-model decoding on a GPU. Models whose caches are not plain
KV caches (sliding windows, SSMs) decode on mlx-lm's growing BatchKVCache instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p


@dataclass
class SamplingParams:
    max_new_tokens: int
    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # decode all max_new_tokens (equal lengths: benchmarks)


@dataclass
class Rollout:
    """One batch step's samples. N = B*G rows; row r belongs to prompt r // G."""

    prompt_ids: list[list[int]]  # B prompts, as fed to the model
    completion_ids: mx.array  # [N, T] int32 sampled ids; pad_id after each completion's end
    mask: mx.array  # [N, T] float32: 1 for sampled completion tokens (incl. the ending EOS)
    sampler_logprobs: mx.array  # [N, T] float32 log-prob of each sampled id under the sampler's logits/T
    truncated: np.ndarray  # [N] bool: hit max_new_tokens without EOS or stop string
    texts: list[str]  # N texts: prefill + decoded completion (without the ending EOS token)
    group_size: int

    @property
    def row_prompts(self) -> list[list[int]]:
        """The prompt of each of the N rows."""
        return [p for p in self.prompt_ids for _ in range(self.group_size)]

    @property
    def lengths(self) -> np.ndarray:
        return np.array(self.mask.sum(axis=1).tolist(), dtype=np.int64)


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


def sample(logits: mx.array, key: mx.array, params: SamplingParams) -> tuple[mx.array, mx.array]:
    """Draw one token per row. logits [N, V] -> (tokens [N], logprobs [N] under logits/temperature).
    temperature 0 is greedy (argmax), with log-probs of the plain logits."""
    if params.temperature == 0:
        logprobs = nn.log_softmax(logits.astype(mx.float32), axis=-1)
        tokens = mx.argmax(logprobs, axis=-1)
        return tokens, mx.take_along_axis(logprobs, tokens[:, None], axis=-1).squeeze(-1)
    logprobs = nn.log_softmax(logits.astype(mx.float32) / params.temperature, axis=-1)  # [N, V]
    filtered = logprobs
    if params.top_k > 0 and params.top_k < logprobs.shape[-1]:
        filtered = apply_top_k(filtered, params.top_k)
    if 0 < params.top_p < 1:
        filtered = apply_top_p(filtered, params.top_p)
    if params.min_p > 0:
        filtered = apply_min_p(filtered, params.min_p)
    tokens = mx.random.categorical(filtered, key=key)  # [N]
    return tokens, mx.take_along_axis(logprobs, tokens[:, None], axis=-1).squeeze(-1)


def _prefill(model: nn.Module, prompts: list[list[int]], pad_id: int) -> tuple[mx.array, list]:
    """Left-pad the B prompts and run them once; -> (last logits [B, V], per-layer caches)."""
    width = max(len(p) for p in prompts)
    padding = [width - len(p) for p in prompts]
    tokens = mx.array([[pad_id] * pad + p for pad, p in zip(padding, prompts)], dtype=mx.int32)  # [B, Lp]
    caches = [BatchKVCache(padding) for _ in model.layers]
    logits = model(tokens, cache=caches)[:, -1, :]  # [B, V]
    return logits, caches


def _repeat_caches(caches: list, group_size: int) -> None:
    """Share each prompt's prefilled cache with its G samples: [B, ...] -> [B*G, ...] in place."""
    for cache in caches:
        cache.keys = mx.repeat(cache.keys, group_size, axis=0)
        cache.values = mx.repeat(cache.values, group_size, axis=0)
        cache.offset = mx.repeat(cache.offset, group_size, axis=0)
        cache.left_padding = mx.repeat(cache.left_padding, group_size, axis=0)


def _stop_cut(tokenizer, ids: list[int], stops: tuple[str, ...]) -> int | None:
    """Number of tokens up to and including the one that completes the first stop string, if any."""
    if not stops or not any(s in tokenizer.decode(ids) for s in stops):
        return None
    lo, hi = 1, len(ids)  # the shortest prefix whose text contains a stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in tokenizer.decode(ids[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return lo


class StaticBatchCache:
    """One layer's KV cache with a fixed capacity: buffers [N, H, S, D] written at position `idx`.

    Row r holds `left_padding[r]` pad positions, then its prompt, then its completion; positions at or
    after idx are empty and masked out, so attending over the whole buffer equals attending over the
    filled part. Implements the cache interface mlx-lm's attention layers use.
    """

    def __init__(self, keys: mx.array, values: mx.array, idx: mx.array, left_padding: mx.array):
        self.keys, self.values = keys, values  # [N, H, S, D]
        self.idx = idx  # int32 scalar: next position to write
        self.left_padding = left_padding  # [N]

    @property
    def offset(self) -> mx.array:
        """RoPE position of the next token, per row: [N]."""
        return self.idx - self.left_padding

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        start = mx.stack([self.idx])
        self.keys = mx.slice_update(self.keys, keys.astype(self.keys.dtype), start, axes=(2,))
        self.values = mx.slice_update(self.values, values.astype(self.values.dtype), start, axes=(2,))
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, **kwargs) -> mx.array:
        positions = mx.arange(self.keys.shape[2])  # [S]
        queries = self.idx + mx.arange(N)  # [N_q]
        visible = positions[None, :] <= queries[:, None]  # [N_q, S] causal, hides the empty tail
        return visible[None, None] & (positions >= self.left_padding[:, None, None, None])  # [N, 1, N_q, S]


def supports_static_cache(model: nn.Module) -> bool:
    """True when every layer uses a plain KV cache (no sliding window or recurrent state)."""
    if not hasattr(model, "make_cache"):
        return True
    return all(type(c) is KVCache for c in model.make_cache())


def _static_caches(caches: list, group_size: int, capacity: int) -> tuple[list, list, mx.array]:
    """Copy the B prefilled caches into [B*G, H, capacity, D] buffers. -> (keys, values, left_padding)."""
    keys, values = [], []
    for cache in caches:
        k, v = cache.keys[..., :cache._idx, :], cache.values[..., :cache._idx, :]  # [B, H, Lp, D]
        tail = [(0, 0), (0, 0), (0, capacity - k.shape[2]), (0, 0)]
        keys.append(mx.repeat(mx.pad(k, tail), group_size, axis=0))
        values.append(mx.repeat(mx.pad(v, tail), group_size, axis=0))
    return keys, values, mx.repeat(caches[0].left_padding, group_size, axis=0)


def make_decode_step(model: nn.Module, params: SamplingParams, eos: mx.array):
    """One compiled decode step: feed the last token, sample the next, update `ended`.
    Compiled per rollout, so the sampler's current weights are the graph's constants."""

    def step(token, key, ended, idx, left_padding, keys, values):
        caches = [StaticBatchCache(k, v, idx, left_padding) for k, v in zip(keys, values)]
        logits = model(token[:, None], cache=caches)[:, -1, :]  # [N, V]
        nxt, logprob = sample(logits, key, params)  # [N], [N]
        ended = ended | (nxt[:, None] == eos[None]).any(axis=1)
        return nxt, logprob, ended, idx + 1, [c.keys for c in caches], [c.values for c in caches]

    return mx.compile(step)


def generate_rollout(model: nn.Module, tokenizer, prompts: list[list[int]], group_size: int,
                     params: SamplingParams, key: mx.array, prefill_text: str = "",
                     sync_every: int = 8, compiled: bool = True) -> Rollout:
    """Sample G completions for each of the B prompts; decoding stops once every row has ended.
    compiled=False (or a model without plain KV caches) decodes step by step on mlx-lm's BatchKVCache."""
    eos_ids = sorted(tokenizer.eos_token_ids)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    if params.ignore_eos:
        eos_ids = []
    eos = mx.array(eos_ids or [-1], dtype=mx.int32)
    logits, caches = _prefill(model, prompts, pad_id)
    logits = mx.repeat(logits, group_size, axis=0)  # [N, V]
    keys = mx.random.split(key, params.max_new_tokens)
    token, logprob = sample(logits, keys[0], params)  # [N], [N]
    tokens, logprobs = [token], [logprob]
    ended = (token[:, None] == eos[None]).any(axis=1)  # [N]
    if compiled and supports_static_cache(model):
        advance = _static_decoder(model, caches, group_size, params, eos)
    else:
        _repeat_caches(caches, group_size)

        def advance(token, key, ended):
            logits = model(token[:, None], cache=caches)[:, -1, :]
            nxt, lp = sample(logits, key, params)
            return nxt, lp, ended | (nxt[:, None] == eos[None]).any(axis=1)
    for step in range(1, params.max_new_tokens):
        if step % sync_every == 0:
            mx.eval(ended)
            if bool(ended.all()) or (params.stop and _all_stopped(tokenizer, tokens, ended, params.stop)):
                break
        token, logprob, ended = advance(token, keys[step], ended)
        tokens.append(token)
        logprobs.append(logprob)
        mx.async_eval(token, logprob, ended)
    ids = mx.stack(tokens, axis=1)  # [N, T]
    lps = mx.stack(logprobs, axis=1)  # [N, T]
    mx.eval(ids, lps)
    return _finish(tokenizer, prompts, ids, lps, eos_ids, pad_id, params, group_size, prefill_text)


def _static_decoder(model: nn.Module, caches: list, group_size: int, params: SamplingParams, eos: mx.array):
    """-> advance(token, key, ended) running the compiled step on fixed-capacity caches it owns."""
    capacity = caches[0]._idx + params.max_new_tokens
    state = dict(zip(("keys", "values", "left_padding"), _static_caches(caches, group_size, capacity)))
    state["idx"] = mx.array(caches[0]._idx, dtype=mx.int32)
    step_fn = make_decode_step(model, params, eos)

    def advance(token, key, ended):
        nxt, lp, ended, state["idx"], state["keys"], state["values"] = step_fn(
            token, key, ended, state["idx"], state["left_padding"], state["keys"], state["values"])
        return nxt, lp, ended

    return advance


def _all_stopped(tokenizer, tokens: list[mx.array], ended: mx.array, stops: tuple[str, ...]) -> bool:
    ids = mx.stack(tokens, axis=1).tolist()
    return all(done or _stop_cut(tokenizer, row, stops) is not None for row, done in zip(ids, ended.tolist()))


def _finish(tokenizer, prompts, ids: mx.array, lps: mx.array, eos_ids: list[int], pad_id: int,
            params: SamplingParams, group_size: int, prefill_text: str) -> Rollout:
    """Cut each row after its EOS (or stop string), build the mask and the texts."""
    rows = ids.tolist()
    eos_set = set(eos_ids)
    T = len(rows[0])
    lengths, texts, truncated = [], [], []
    for row in rows:
        end = next((i + 1 for i, t in enumerate(row) if t in eos_set), None)
        cut = _stop_cut(tokenizer, row[:end] if end else row, params.stop)
        if cut is not None:
            end = cut
        truncated.append(end is None)
        length = end if end is not None else T
        lengths.append(length)
        body = row[:length - 1] if length and row[length - 1] in eos_set else row[:length]
        texts.append(prefill_text + tokenizer.decode(body))
    mask = (mx.arange(T)[None, :] < mx.array(lengths)[:, None]).astype(mx.float32)  # [N, T]
    completion_ids = mx.where(mask > 0, ids, pad_id).astype(mx.int32)
    return Rollout(prompt_ids=[list(p) for p in prompts], completion_ids=completion_ids, mask=mask,
                   sampler_logprobs=lps * mask, truncated=np.array(truncated), texts=texts,
                   group_size=group_size)
