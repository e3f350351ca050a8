"""The rollout engine: the one place that turns prompts into sampled completions (Rollout records).

It owns the sampling copy of the policy (models/decoder.py: fused projections, adapters merged, the
compute dtype), refreshed by the trainer after every optimizer update, and the decode loop over it:
each step is one compiled graph (the model's step plus sampling), the KV cache is written outside it,
and rows that have ended are dropped from the batch once at most half of it is still live (the batch
shrinks to the next power of two, so few shapes are ever compiled). A row's tokens depend only on its
own key and context, so dropping other rows leaves them unchanged.

Models the copy does not cover (other families, quantized weights: QLoRA bases and
quantize_for_rollouts, whose memory saving the copy would undo) decode through rollout.py's
generate_rollout on the model itself.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_grpo.models import decoder
from mlx_grpo.models.forward import bucket
from mlx_grpo.rollout import (Rollout, SamplingParams, finish_rollout, generate_rollout, make_sampler, sample,
                              stop_cut)

# A batch is compacted only down to this many rows: below it a decode step costs the same whatever the rows.
MIN_ROWS = 8


def _quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())


class RolloutEngine:
    """Samples rollouts from the policy it was last refreshed with.

    compact: drop ended rows from the batch (False: every row decodes to the end, for comparisons).
    fused: use the sampling copy where it serves the model (False: always decode the model itself).
    """

    def __init__(self, tokenizer, *, compact: bool = True, fused: bool = True, sync_every: int = 8):
        self.tokenizer = tokenizer
        self.compact = compact
        self.fused = fused
        self.sync_every = sync_every
        self.model = None
        self.spec = self.weights = None
        self._steps = {}
        self.row_steps = 0  # rows x decode steps the last fused rollout computed (what compaction saves)

    def refresh(self, model: nn.Module) -> "RolloutEngine":
        """Sample from `model`'s current weights from now on (rebuilds the sampling copy)."""
        self.model = model
        self.spec = self.weights = None
        if self.fused and decoder.supports(model) and not _quantized(model):
            self.spec, self.weights = decoder.build(model, _compute_dtype(model))
        return self

    @property
    def uses_copy(self) -> bool:
        return self.weights is not None

    def generate(self, prompts: list[list[int]], group_size: int, params: SamplingParams, key: mx.array,
                 prefill_text: str = "") -> Rollout:
        """G completions for each of the B prompts. key: one key (split into the N = B*G row keys) or the row
        keys themselves, [N, 2]."""
        if self.model is None:
            raise RuntimeError("RolloutEngine.generate before refresh(model)")
        if not self.uses_copy:
            return generate_rollout(self.model, self.tokenizer, prompts, group_size, params, key, prefill_text,
                                    sync_every=self.sync_every)
        return self._generate_fused(prompts, group_size, params, key, prefill_text)

    # ------------------------------------------------------------------ the fused decode loop
    def _step_fn(self, params: SamplingParams, eos: tuple[int, ...], kernel: bool):
        """The compiled decode step for these sampling settings (traced once per batch shape)."""
        cache_key = (params.temperature, params.top_p, params.top_k, params.min_p, eos, kernel)
        if cache_key not in self._steps:
            spec, eos_array = self.spec, mx.array(list(eos) or [-1], dtype=mx.int32)

            def step(weights, token, keys, values, offset, start, stop, row_keys, ended):
                logits, new_k, new_v = decoder.decode_step(spec, weights, token, keys, values, offset, start,
                                                           stop, kernel)
                token, logprob, entropy = sample(logits, row_keys, params)
                ended = ended | (token[:, None] == eos_array[None]).any(axis=1)
                return token, logprob, entropy, ended, new_k, new_v

            self._steps[cache_key] = mx.compile(step)
        return self._steps[cache_key]

    def _generate_fused(self, prompts, group_size: int, params: SamplingParams, key: mx.array,
                        prefill_text: str) -> Rollout:
        tokenizer, spec, weights = self.tokenizer, self.spec, self.weights
        eos_ids = sorted(tokenizer.eos_token_ids)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
        if params.ignore_eos:
            eos_ids = []
        eos = mx.array(eos_ids or [-1], dtype=mx.int32)
        G, T = group_size, params.max_new_tokens
        width = bucket(max(len(p) for p in prompts))
        padding = mx.array([width - len(p) for p in prompts], dtype=mx.int32)  # [B]
        tokens = mx.array([[pad_id] * (width - len(p)) + list(p) for p in prompts], dtype=mx.int32)
        logits, keys, values = decoder.prefill(spec, weights, tokens, padding)  # [B, V], [B, Hkv, width, Dh]
        # one buffer for all layers [layers, N, Hkv, width + T, Dh]: a step writes every layer's key at once
        tail = [(0, 0), (0, 0), (0, 0), (0, T), (0, 0)]  # room for every generated token
        keys = mx.repeat(mx.pad(mx.stack(keys), tail), G, axis=1)
        values = mx.repeat(mx.pad(mx.stack(values), tail), G, axis=1)
        start = mx.repeat(padding, G)  # [N] first real slot of each row
        logits = mx.repeat(logits, G, axis=0)  # [N, V]
        n = logits.shape[0]
        row_keys = key if key.ndim == 2 else mx.random.split(key, n)  # [N, 2]
        step_keys = mx.vmap(lambda k: mx.random.split(k, T))(row_keys).transpose(1, 0, 2)  # [T, N, 2]
        mx.eval(keys, values, step_keys)
        token, logprob, entropy, ended = make_sampler(params, eos)(logits, step_keys[0],
                                                                  mx.zeros((n,), dtype=mx.bool_))
        kernel = decoder.kernel_serves(spec)
        step = self._step_fn(params, tuple(eos_ids), kernel)
        rows = np.arange(n)  # the rollout row of each batch slot
        self.row_steps = n
        segments, columns = [], ([token], [logprob], [entropy])
        first = 0  # the column where the current segment starts
        idx = width  # the slot the next fed token is written to
        for s in range(1, T):
            if s % self.sync_every == 0:
                mx.eval(ended)
                done = np.array(ended)
                if params.stop:
                    done |= self._stopped(segments, (rows, first, columns), n, params.stop)
                if done.all():
                    break
                live = np.flatnonzero(~done)
                if self.compact and len(rows) > MIN_ROWS and len(live) <= len(rows) // 2:
                    size = max(MIN_ROWS, 1 << int(np.ceil(np.log2(max(len(live), 1)))))
                    keep = np.concatenate([live, np.flatnonzero(done)[:size - len(live)]])
                    segments.append((rows, first, columns))
                    first, rows = s, rows[keep]
                    pick = mx.array(keep)
                    keys, values = keys[:, pick], values[:, pick]
                    start, step_keys, ended = start[pick], step_keys[:, pick], ended[pick]
                    token = token[pick]
                    columns = ([], [], [])
            stop = mx.array([idx], dtype=mx.int32)
            token, logprob, entropy, ended, new_k, new_v = step(weights, token, keys, values, idx - start, start,
                                                                stop, step_keys[s], ended)
            keys[..., idx:idx + 1, :] = new_k  # in place, outside the compiled graph (inside, it would copy)
            values[..., idx:idx + 1, :] = new_v
            idx += 1
            self.row_steps += len(rows)
            for column, value in zip(columns, (token, logprob, entropy)):
                column.append(value)
            mx.async_eval(token, logprob, entropy, ended)
        segments.append((rows, first, columns))
        ids, lps, ents = _assemble(segments, n, pad_id)
        return finish_rollout(tokenizer, prompts, ids, lps, ents, eos_ids, pad_id, params, G, prefill_text)

    def _stopped(self, segments, current, n: int, stops) -> np.ndarray:
        """Which of the batch's current rows have generated a stop string so far."""
        ids, _, _ = _assemble(segments + [current], n, -1)
        return np.array([stop_cut(self.tokenizer, [t for t in row if t >= 0], stops) is not None
                         for row in np.array(ids)[current[0]].tolist()])


def _assemble(segments, n: int, pad_id: int) -> tuple[mx.array, mx.array, mx.array]:
    """Scatter the segments' columns back to rollout rows: -> ids, log-probs, entropies, each [n, T];
    a row's columns after it left the batch hold pad_id / 0 (it had ended)."""
    width = max(first + len(cols[0]) for _, first, cols in segments)
    ids = np.full((n, width), pad_id, dtype=np.int64)
    lps = np.zeros((n, width), dtype=np.float32)
    ents = np.zeros((n, width), dtype=np.float32)
    for rows, first, (t, lp, ent) in segments:
        if not t:
            continue
        stop = first + len(t)
        ids[rows, first:stop] = np.array(mx.stack(t, axis=1))
        lps[rows, first:stop] = np.array(mx.stack(lp, axis=1))
        ents[rows, first:stop] = np.array(mx.stack(ent, axis=1))
    return mx.array(ids.astype(np.int32)), mx.array(lps), mx.array(ents)


def _compute_dtype(model: nn.Module):
    """The dtype the sampling copy computes in: that of the model's embedding (its compute dtype)."""
    inner = model.model
    weight = inner.embed_tokens.weight
    return inner.embed_tokens.scales.dtype if isinstance(inner.embed_tokens, nn.QuantizedEmbedding) else weight.dtype
