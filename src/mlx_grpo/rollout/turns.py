"""The rollout engine's side of multi-turn decoding (engine.generate_many with `turns`, multiturn.py).

Owns `TurnRows`: per engine row, the length of the context it decoded from; handing rows that are done to
turns.ended and queueing the next turns turns.take hands back; and (keep_turn_cache) each row's KV block while
its environment answers. A row whose turn ended keeps the cache entries of its context and of its turn's
accepted tokens but the last one; its next turn prefills only the rest (that last token and the environment's
answer) on top of them (`prefill_resumed`), where the re-prefill path prefills the whole context again.

Why that cut: a token's keys exist once the token was fed back, which for the turn's last accepted token
depends on where the loop's sync fell; cutting before it makes which keys come from the decode and which from
the prefill a function of the row alone, so its tokens never depend on the batch around it. The block is
copied out of the batch at the sync that reports the row (the slot is freed as before) and enters the batch
again in the refill's write (in place or its one concatenation), so keeping it adds no copy of the whole cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlx_grpo.models import decoder
from mlx_grpo.models.forward import bucket, rows_to_bucket


@dataclass(frozen=True)
class Kept:
    """A row's kept cache: slots offset, ..., offset + length - 1 of keys and values [slots, layers, Hkv, Dh],
    which may hold the blocks of other rows reported at the same sync (one gather for all of them)."""

    keys: mx.array
    values: mx.array
    offset: int
    length: int

    @staticmethod
    def of(keys: mx.array, values: mx.array) -> "Kept":
        """One row's block from its keys and values [layers, Hkv, P, Dh]."""
        return Kept(keys.transpose(2, 0, 1, 3), values.transpose(2, 0, 1, 3), 0, keys.shape[2])


class TurnRows:
    """turns: multiturn's hooks (ended / take / pending). keep: keep each row's cache for its next turn.
    prompts: the prompts' lengths, each starting G rows. wait: report waits for its sync's gather of kept blocks;
    False (the loop's lookahead): it only queues it, so the host goes on while the device runs the steps before it
    (the gather is queued ahead of whatever later writes the cache, on the one stream)."""

    def __init__(self, turns, keep: bool, prompts: list[int], G: int, wait: bool = True):
        self.turns, self.keep, self.wait = turns, keep, wait
        self.context_len = [n for n in prompts for _ in range(G)]  # engine row -> its context's length
        self.blocks: dict[int, Kept] = {}  # engine row -> its kept keys and values

    def pending(self) -> bool:
        """Whether any row handed to turns.ended may still go on (its next turn not yet taken)."""
        return self.turns.pending()

    @property
    def at_once(self) -> bool:
        """Whether the environment answers in microseconds (Environment.answers_at_once): the loop takes the next
        turns at the sync that reported them, instead of at the next one."""
        return self.turns.at_once

    def report(self, written, rows: np.ndarray, done: np.ndarray, reported: np.ndarray, keys: mx.array,
               values: mx.array, start: mx.array) -> None:
        """Hand each row of the batch that is done and not yet reported to turns.ended, with the tokens,
        log-probs and entropies it wrote (written: columns.Written.update's); keep: copy the KV block of each one
        that may go on out of its slot (keys, values [layers, slots, Hkv, S, Dh]; start [slots]), all of this
        sync's blocks in one gather."""
        ids, lps, ents, filled = written
        spans = []
        for slot, r in ((i, int(r)) for i, (r, d) in enumerate(zip(rows, done)) if d and r >= 0 and not reported[r]):
            reported[r] = True
            n = int(filled[r])
            accepted = self.turns.ended(r, ids[r, :n].tolist(), lps[r, :n].tolist(), ents[r, :n].tolist())
            if self.keep and accepted is not None:
                spans.append((slot, r, self.context_len[r] + accepted - 1))
        if spans:
            self.keep_blocks(spans, keys, values, start)

    def keep_blocks(self, spans: list, keys: mx.array, values: mx.array, start: mx.array) -> None:
        """Copy each span's (slot, row, tokens kept) KV block out of the batch's cache in one gather: report's
        device work, apart from its host work (tools_bench --phases times them apart)."""
        first = np.array(start)
        slots = np.array([slot for slot, _, _ in spans])
        kept = np.array([n for _, _, n in spans])
        at = np.concatenate([first[slot] + np.arange(n) for slot, _, n in spans])
        # a gather: a block of its own, so the cache's buffer stays free to be written in place
        pick = (mx.array(np.repeat(slots, kept)), mx.array(at))
        block_k, block_v = keys[:, pick[0], :, pick[1]], values[:, pick[0], :, pick[1]]  # [sum kept, layers, Hkv, Dh]
        (mx.eval if self.wait else mx.async_eval)(block_k, block_v)
        offsets = np.concatenate([[0], np.cumsum(kept)[:-1]])
        for (_, r, n), offset in zip(spans, offsets):
            self.blocks[r] = Kept(block_k, block_v, int(offset), int(n))

    def take(self, entries: list, queue: list, n_rows: int, T: int, all_keys, join, limit, reported):
        """Queue the next turns turns.take() hands back (waiting for their environment steps; their keys [turns, 2]
        in one array), ahead of the prompts still waiting: each a row numbered after the n_rows so far, its entry
        (context, row, 1, kept block or None). -> the per-row state (n_rows, step keys, join, limit, reported)
        with those rows appended."""
        added, turn_keys = self.turns.take(n_rows)
        for i, (context, _, prior) in enumerate(added):
            kept = self.blocks.pop(prior, None)
            if kept is not None and kept.length >= len(context):
                raise RuntimeError(f"row {prior}'s kept cache covers its whole next context")
            entries.append((context, n_rows + i, 1, kept))
            self.context_len.append(len(context))
        self.blocks.clear()  # take answers every row reported so far: the rest's episodes ended
        if not added:
            return n_rows, all_keys, join, limit, reported
        queue[:0] = range(len(entries) - len(added), len(entries))  # an episode ends sooner than a new one
        keys = mx.vmap(lambda k: mx.random.split(k, T))(turn_keys)
        return (n_rows + len(added), mx.concatenate([all_keys, keys]),
                np.concatenate([join, np.zeros(len(added), np.int64)]),
                np.concatenate([limit, np.array([b for _, b, _ in added], np.int64)]),
                np.concatenate([reported, np.zeros(len(added), bool)]))


def prefill_resumed(spec, weights: dict, admitted: list, at: int, pad_id: int):
    """The next turns of rows that kept their cache, admitted = [(context, Kept of context[:P])]: their contexts'
    cache ending at slot `at`, only context[P:] prefilled. -> (keys, values [layers, rows, Hkv, W, Dh]: the W
    slots at - W .. at - 1 the contexts fill (W bucketed, at most at), start [rows], last logits [rows, V], tokens
    prefilled)."""
    real = len(admitted)
    admitted = rows_to_bucket(admitted)  # a power of two of rows, as prefill_contexts'
    lengths = [len(c) for c, _ in admitted]
    width = bucket(max(lengths))  # bucketed widths, the slots before at - width dropped after, as prefill_contexts'
    chunks = [c[kept.length:] for c, kept in admitted]
    C = min(bucket(max(len(c) for c in chunks)), width)
    # each past right before its chunk, the chunks ending at the timeline's last slot, zeros elsewhere: one
    # gather from the blocks (and a zero slot after them) for all rows
    sources, base = {}, []
    for _, kept in admitted:
        if id(kept.keys) not in sources:
            sources[id(kept.keys)] = (kept, sum(s.keys.shape[0] for s, _ in sources.values()))
        base.append(sources[id(kept.keys)][1] + kept.offset)
    zero = sum(s.keys.shape[0] for s, _ in sources.values())
    index = np.full((len(admitted), width), zero, dtype=np.int64)
    for i, (n, b, (_, kept)) in enumerate(zip(lengths, base, admitted)):
        index[i, width - n:width - n + kept.length] = b + np.arange(kept.length)
    index, blocks = mx.array(index), [kept for kept, _ in sources.values()]
    zeros = mx.zeros((1, *blocks[0].keys.shape[1:]), blocks[0].keys.dtype)
    past_k, past_v = (mx.concatenate([getattr(b, name) for b in blocks] + [zeros])[index].transpose(2, 0, 3, 1, 4)
                      for name in ("keys", "values"))  # [layers, rows, Hkv, width, Dh]
    tokens = mx.array([[pad_id] * (C - len(c)) + list(c) for c in chunks], dtype=mx.int32)
    padding = mx.array([C - len(c) for c in chunks], dtype=mx.int32)
    start = mx.array([width - n for n in lengths], dtype=mx.int32)
    logits, keys, values = decoder.prefill_after(spec, weights, tokens, padding, past_k, past_v, start)
    cut = max(0, width - at)
    # the real rows only
    keys, values = mx.contiguous(keys[:, :real, :, cut:]), mx.contiguous(values[:, :real, :, cut:])
    mx.async_eval(keys, values)  # queued (the gathered pasts freed once it runs); the host goes on to the write
    return keys, values, (start + (at - width))[:real], logits[:real], sum(len(c) for c in chunks[:real])
