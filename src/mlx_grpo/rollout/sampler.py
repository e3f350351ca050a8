"""Sampling one token per row with the row's own key (temperature, top-k / top-p / min-p), the compiled
per-step sampler of the decode loop (loop.py), where a row ends (end tokens, stop strings found as tokens
arrive; closing_tokens: the ids that can complete one), the text of a row's ids and the ids of a text
(text_decoder, text_encoder), and finish_rollout: the sampled ids [N, T] cut at each row's end into a Rollout."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p
from mlx_lm.tokenizer_utils import TokenizerWrapper
from transformers import PreTrainedTokenizerFast
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from mlx_grpo.kernels.keyed_sampler import categorical
from mlx_grpo.rollout.rollout_records import Rollout, SamplingParams


def _entropy(logprobs: mx.array) -> mx.array:
    """-sum p log p of each row. logprobs [N, V] -> [N]."""
    return -(mx.exp(logprobs) * logprobs).sum(axis=-1)


def sample(logits: mx.array, keys: mx.array, params: SamplingParams) -> tuple[mx.array, mx.array, mx.array]:
    """Draw one token per row with that row's key. logits [N, V], keys [N, 2] -> (tokens [N], logprobs [N]
    under logits/temperature, entropy [N] of that distribution, before any top-k/top-p/min-p cut).
    temperature 0 is greedy (argmax), with log-probs of the plain logits."""
    if params.temperature == 0:
        logprobs = nn.log_softmax(logits.astype(mx.float32), axis=-1)
        tokens = mx.argmax(logprobs, axis=-1)
        return tokens, mx.take_along_axis(logprobs, tokens[:, None], axis=-1).squeeze(-1), _entropy(logprobs)
    logprobs = nn.log_softmax(logits.astype(mx.float32) / params.temperature, axis=-1)  # [N, V]
    filtered = logprobs
    if params.top_k > 0 and params.top_k < logprobs.shape[-1]:
        filtered = apply_top_k(filtered, params.top_k)
    if 0 < params.top_p < 1:
        filtered = apply_top_p(filtered, params.top_p)
    if params.min_p > 0:
        filtered = apply_min_p(filtered, params.min_p)
    tokens = categorical(filtered, keys)  # [N]: MLX's per-row draws (kernels/keyed_sampler.py on CUDA)
    return tokens, mx.take_along_axis(logprobs, tokens[:, None], axis=-1).squeeze(-1), _entropy(logprobs)


def pad_token_id(tokenizer) -> int:
    """What pads rollout rows and batches: the pad token, or the lowest end token when the tokenizer has none."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else sorted(tokenizer.eos_token_ids)[0]


def end_ids(tokenizer, params: SamplingParams) -> tuple[list[int], int]:
    """(the ids that end a row: none with ignore_eos, the pad id written after a row's end)."""
    return ([] if params.ignore_eos else sorted(tokenizer.eos_token_ids)), pad_token_id(tokenizer)


def text_decoder(tokenizer):
    """ids (a list of ints) -> tokenizer.decode(ids), the `tokenizers` backend called directly where that is all
    decode does (a fast Hugging Face tokenizer, decode and _decode not overridden, no space clean-up): the
    wrapper converts every id on every call, ~5x the decode itself, and rollouts decode rows at every sync."""
    backend = _decoding_backend(tokenizer)
    if backend is None:
        return tokenizer.decode
    return lambda ids: backend.decode(ids, skip_special_tokens=False)


def _hugging_face(tokenizer):
    """The Hugging Face tokenizer itself: mlx-lm's TokenizerWrapper's, or tokenizer."""
    return tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer


def _decoding_backend(tokenizer):
    """The `tokenizers` backend whose decode is tokenizer.decode's, or None (text_decoder's test)."""
    hf = _hugging_face(tokenizer)
    if not (isinstance(hf, PreTrainedTokenizerFast) and type(hf)._decode is PreTrainedTokenizerFast._decode
            and type(hf).decode is PreTrainedTokenizerBase.decode and not hf.clean_up_tokenization_spaces):
        return None
    return hf.backend_tokenizer


def _byte_level(backend) -> bool:
    """Whether the backend's decoder is byte-level: GPT-2's ByteLevel, alone or as a sequence's only decoder."""
    if backend.decoder is None:
        return False
    decoder = json.loads(backend.decoder.__getstate__())  # the decoder's own JSON, not the whole tokenizer's
    if decoder.get("type") == "Sequence" and len(decoder.get("decoders", [])) == 1:
        decoder = decoder["decoders"][0]
    return decoder.get("type") == "ByteLevel"


def closing_tokens(tokenizer, stops: tuple[str, ...]) -> np.ndarray | None:
    """The ids that can complete one of `stops`, as a table [V + 2] of bool to index with ids: True for each id
    whose own text holds a stop string's last character, and at V (ids past the vocabulary, clipped there); False
    at the last entry (index -1: a column not yet written). With a byte-level decoder (GPT-2's: Llama 3, Qwen,
    SmolLM; LFM2's, alone in a sequence) an ASCII character is its byte, which decodes to itself whatever
    surrounds it, so a stop string ending in one is completed by a token holding that byte, and a prefix's text
    that holds a stop string keeps it as tokens follow: a row whose new tokens hold none of these has not
    completed one (StopRows skips its scan). None where that is not known to hold: other decoders
    (SentencePiece's byte fallback writes a '>' byte before a lead byte as two replacement characters, the '>'
    appearing only with the bytes after it), stop strings ending in a non-ASCII or white-space character or
    empty, a decode of its own."""
    backend = _decoding_backend(tokenizer)
    if not stops or not all(stops) or backend is None or not _byte_level(backend):
        return None
    lasts = {s[-1] for s in stops}
    if not all(c.isascii() and not c.isspace() for c in lasts):
        return None
    V = backend.get_vocab_size(with_added_tokens=True)
    texts = backend.decode_batch([[i] for i in range(V)], skip_special_tokens=False)  # ~35 ms for 49k ids
    return np.array([any(c in t for c in lasts) for t in texts] + [True, False])


def text_encoder(tokenizer):
    """text -> its ids without special tokens added (tokenizer.encode(text, add_special_tokens=False) as a list),
    the `tokenizers` backend called directly where that is all encode does (as text_decoder: a fast tokenizer
    whose encode is not overridden, no truncation or padding set on the backend, special tokens split as the
    wrapper would): the wrapper builds a batch and its encodings for each call, ~3x the encode of a tool's
    short output, which multi-turn rollouts encode for every call."""
    hf = _hugging_face(tokenizer)
    if not (isinstance(hf, PreTrainedTokenizerFast) and type(hf).encode is PreTrainedTokenizerBase.encode
            and type(hf)._encode_plus is PreTrainedTokenizerFast._encode_plus):
        return lambda text: list(tokenizer.encode(text, add_special_tokens=False))
    backend = hf.backend_tokenizer

    def encode(text: str) -> list[int]:
        if (backend.truncation is not None or backend.padding is not None
                or backend.encode_special_tokens != bool(getattr(hf, "split_special_tokens", False))):
            return list(hf.encode(text, add_special_tokens=False))  # what the wrapper would set first
        return backend.encode(text, add_special_tokens=False).ids
    return encode


def stop_cut(tokenizer, ids: list[int], stops: tuple[str, ...], closing: np.ndarray | None = None) -> int | None:
    """Number of tokens up to and including the one that completes the first stop string, if any. closing:
    closing_tokens' table for stops, whose ids are the only ones that can complete a stop string: the same search
    over the positions after them only (a decode or two for a tool call's turn, where all positions take
    ~log2(len))."""
    decode = text_decoder(tokenizer)
    if not stops or not any(s in decode(ids) for s in stops):
        return None
    if closing is None:
        return _first_stop(decode, ids, stops)
    last = len(closing) - 2
    ends = [i + 1 for i, t in enumerate(ids) if closing[min(t, last)]]
    if not ends:  # a table not made for these stops: the search over every position
        return _first_stop(decode, ids, stops)
    return ends[_first_holding(lambda k: decode(ids[:ends[k - 1]]), len(ends), stops) - 1]


def _first_stop(decode, ids: list[int], stops: tuple[str, ...]) -> int:
    """stop_cut of ids whose text (decode: text_decoder's) is known to hold a stop string."""
    return _first_holding(lambda n: decode(ids[:n]), len(ids), stops)


def _first_holding(text, n: int, stops: tuple[str, ...]) -> int:
    """The least k in 1..n whose text(k) holds a stop string, text(n) known to: a binary search (a prefix whose text
    holds a stop string keeps it as tokens follow)."""
    lo, hi = 1, n
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in text(mid) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return lo


class StopScanner:
    """Finds rows' first stop string as their tokens arrive, scan after scan: each scan decodes only the
    tokens since the row's last scan plus a margin before them (wide enough for a stop string that started
    there), and the whole row is decoded only when that tail holds a stop; a row with no token since its last
    clean scan is not decoded again. One per decode loop."""

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.decode, self.stops = text_decoder(tokenizer), stops
        # a stop string spans at most one token per UTF-8 byte (a byte-level or byte-fallback tokenizer writes a
        # 4-byte character as up to 4 tokens; counting characters missed a stop of five emoji); leading-space
        # and byte-fallback tokens can render differently at a window's start, hence the slack
        self.margin = 2 * max((len(s.encode("utf-8")) for s in stops), default=0) + 8
        self._clean: dict[int, int] = {}  # row -> tokens scanned without a stop

    def _has_stop(self, ids: list[int]) -> bool:
        return any(s in self.decode(ids) for s in self.stops)

    def mark_clean(self, row: int, n: int) -> None:
        """Row's first n tokens are known to hold no stop string (StopRows' closing-token test)."""
        self._clean[row] = n

    def stopped(self, row: int, ids: list[int]) -> bool:
        """Whether row's text (ids, its tokens so far) holds a stop string."""
        clean = self._clean.get(row, 0)
        if len(ids) == clean:  # nothing new since a clean scan
            return False
        if not self._has_stop(ids[max(0, clean - self.margin):]):
            self._clean[row] = len(ids)
            return False
        return self._has_stop(ids)

    def first_stop(self, ids: list[int]) -> int:
        """stop_cut(ids) of ids whose text is known to hold a stop string (stopped said so)."""
        return _first_stop(self.decode, ids, self.stops)

    def cut(self, row: int, ids: list[int]) -> int | None:
        """stop_cut(ids): the tokens up to and including the one that completes the first stop string."""
        return self.first_stop(ids) if self.stopped(row, ids) else None


def make_sampler(params: SamplingParams, eos: mx.array):
    """(logits [N, V], keys [N, 2], ended [N]) -> (token [N], logprob [N], entropy [N], ended [N]), compiled: one
    fused graph instead of ~10 separately dispatched ops per decode step. Built (and traced) once per rollout."""

    def step(logits, keys, ended):
        token, logprob, entropy = sample(logits, keys, params)
        return token, logprob, entropy, ended | (token[:, None] == eos[None]).any(axis=1)

    return mx.compile(step)


def completion_end(tokenizer, ids: list[int], eos: set[int], stops: tuple[str, ...],
                   closing: np.ndarray | None = None) -> int | None:
    """Tokens of a completion up to and including its first end token, or the token that completes its
    first stop string before that; None when it has neither (it ran to its length). closing: as stop_cut's."""
    end = next((i + 1 for i, t in enumerate(ids) if t in eos), None)
    cut = stop_cut(tokenizer, ids[:end] if end else ids, stops, closing)
    return cut if cut is not None else end


def finish_rollout(tokenizer, prompts, ids: mx.array, lps: mx.array, ents: mx.array, eos_ids: list[int], pad_id: int,
            params: SamplingParams, group_size: int, prefill_text: str) -> Rollout:
    """Cut each row after its EOS (or stop string), build the mask and the texts."""
    rows, decode = ids.tolist(), text_decoder(tokenizer)
    eos_set = set(eos_ids)
    T = len(rows[0])
    lengths, texts, truncated = [], [], []
    for row in rows:
        end = completion_end(tokenizer, row, eos_set, params.stop)
        truncated.append(end is None)
        length = end if end is not None else T
        lengths.append(length)
        body = row[:length - 1] if length and row[length - 1] in eos_set else row[:length]
        texts.append(prefill_text + decode(body))
    mask = (mx.arange(T)[None, :] < mx.array(lengths)[:, None]).astype(mx.float32)  # [N, T]
    completion_ids = mx.where(mask > 0, ids, pad_id).astype(mx.int32)
    return Rollout(prompt_ids=[list(p) for p in prompts], completion_ids=completion_ids, mask=mask,
                   sampler_logprobs=lps * mask, truncated=np.array(truncated), texts=texts,
                   group_size=group_size, entropies=ents * mask)
