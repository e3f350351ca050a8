"""The engine's decoder for the one decode loop (loop.decode_rows): the sampling copy of the policy
(models/decoder.py) on its own static KV cache, [layers, slots, Hkv, capacity, Dh] keys and values, one slot a
step. Each step is one compiled graph (the copy's step plus sampling, compiled by engine.RolloutEngine); where the
fused CUDA kernel serves it writes the token's keys and values into the cache itself, in place (step_writes),
otherwise they are written outside the graph (a copy of the cache while the last step still runs). Between steps
the batch can change (refills): some slots kept (compaction, a gather), new rows' contexts prefilled into done
rows' slots in place (admit_into) or appended to the batch (admit, a new cache: `placed`), a row's next turn
prefilled on its kept KV block (rollout/turns.py), and the cache's blocks handed to the turns. cache_copies: how
many caches those moves hold at once, for the memory check before a run.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_grpo.kernels.cache_write import write_rows
from mlx_grpo.models import compiled_decode, decoder
from mlx_grpo.models.forward import bucket, rows_to_bucket
from mlx_grpo.rollout.loop import MIN_ROWS, rebuilt_rows
from mlx_grpo.rollout.turns import prefill_resumed


class CopyDecoder:
    """spec, weights: the sampling copy (weights as the step reads them: decode_graph's layout when graph).
    step_fn: the compiled step for this rollout's sampling settings; step_writes: it writes each token's keys
    and values into the cache itself (the fused kernel's write_cache); in_place: refills may write admitted
    rows into done rows' slots (admit_into). idx: the slot the next fed token is written to; start [slots]: each
    slot's first attended slot."""

    refills = True

    def __init__(self, spec, weights: dict, step_fn, graph: bool, pad_id: int, step_writes: bool = False,
                 in_place: bool = True):
        self.spec, self.weights, self.step_fn, self.graph, self.pad_id = spec, weights, step_fn, graph, pad_id
        self.step_writes, self.in_place = step_writes, in_place
        # prefills read the model's layout of the weights (decode_graph stores matrices transposed), with each
        # matrix's transpose kept beside it (decoder.prefill_layout: fewer operations per refill)
        self.prefill_weights = decoder.prefill_layout(compiled_decode.model_layout(weights) if graph else weights)
        self.prefilled_tokens = 0  # context tokens prefilled (what kept turn caches save)
        self.keys = self.values = self.start = None
        self.idx = 0
        self.slot, self.slot_at = None, -1  # slot: idx as a device array (decode_graph), valid at slot_at

    def prefill_contexts(self, contexts: list[list[int]], at: int):
        """Prefill each context once, ending at slot `at`. -> (keys, values [layers, contexts, Hkv, W, Dh]: the W
        slots at - W .. at - 1 the contexts fill, start [contexts], last logits [contexts, V])."""
        self.prefilled_tokens += sum(len(c) for c in contexts)
        n, longest = len(contexts), max(len(c) for c in contexts)
        # few distinct shapes (on CUDA, cuDNN builds an attention graph per shape): bucketed widths, the slots
        # before `at - width` (left padding of every row) dropped after, and row_bucket(n) rows, the first context
        # repeated (each row attends only to itself)
        width = bucket(longest)
        cut, contexts = max(0, width - at), rows_to_bucket(contexts)
        padding = mx.array([width - len(c) for c in contexts], dtype=mx.int32)
        tokens = mx.array([[self.pad_id] * (width - len(c)) + list(c) for c in contexts], dtype=mx.int32)
        logits, keys, values = decoder.prefill(self.spec, self.prefill_weights, tokens, padding)  # [b, V], [b, ...]
        keys, values = (mx.stack([a[:n, :, cut:] for a in arrays]) for arrays in (keys, values))  # the real rows only
        return keys, values, (padding + (at - width))[:n], logits[:n]

    def prefill(self, contexts: list[list[int]], counts: list[int], at: int):
        """prefill_contexts with each context's block repeated into counts[i] rows (a prompt's G samples share one
        prefill): keys, values [layers, rows, Hkv, W, Dh], start [rows], logits [rows, V]."""
        keys, values, start, logits = self.prefill_contexts(contexts, at)
        repeat = context_rows(counts)
        keys, values = keys[:, repeat], values[:, repeat]
        mx.async_eval(keys, values)  # queued: an admission in place goes on to its write while the device prefills
        return keys, values, start[repeat], logits[repeat]

    def begin(self, contexts: list[list[int]], counts: list[int], T: int) -> mx.array:
        """The batch's first rows: their contexts prefilled with room for T tokens each. -> logits [rows, V]."""
        self.idx = bucket(max(len(c) for c in contexts))
        keys, values, start, logits = self.prefill_contexts(contexts, self.idx)
        mx.eval(keys, values)
        repeat = context_rows(counts)
        self.start = start[repeat]
        layers, P, Hkv, W, Dh = keys.shape
        # each context's block at the cache's capacity, then gathered into its rows (a gather, exact past 2^31
        # elements): the rows exist once, in the cache (no rows x W block beside it)
        for name, block in (("keys", keys), ("values", values)):
            setattr(self, name, placed((layers, P, Hkv, self.idx + T, Dh), [(block, 0, self.idx - W)])[:, repeat])
            mx.eval(getattr(self, name))
        return logits[repeat]

    def step(self, token, row_keys, kstep, ended, sampler):
        """The loop's step (the compiled graph samples itself; `sampler` is the first tokens')."""
        if self.graph:  # the slot stays on the device; the graph advances it
            if self.slot_at != self.idx:
                self.slot = mx.array([self.idx], dtype=mx.int32)
            token, logprob, entropy, ended, new_k, new_v, self.slot, kstep = self.step_fn(
                self.weights, token, self.keys, self.values, self.slot, self.start, kstep, row_keys, ended)
            self.slot_at = self.idx + 1
        else:
            token, logprob, entropy, ended, new_k, new_v = self.step_fn(
                self.weights, token, self.keys, self.values, self.idx - self.start, self.start,
                mx.array([self.idx], dtype=mx.int32), row_keys, ended)
            kstep = kstep + 1
        # Both steps: a static slice outside the compiled graph (an array offset, or a write inside the graph,
        # costs more: compiled_decode.py). It still copies the cache while the last step runs on the GPU, which
        # a step that writes the cache itself avoids.
        if not self.step_writes:
            self.keys[..., self.idx:self.idx + 1, :] = new_k
            self.values[..., self.idx:self.idx + 1, :] = new_v
        self.idx += 1
        return token, logprob, entropy, ended, kstep

    @property
    def cache(self) -> tuple[mx.array, mx.array, mx.array]:
        """(keys, values [layers, slots, Hkv, S, Dh], start [slots]): what turns.TurnRows.report copies blocks from."""
        return self.keys, self.values, self.start

    def fits(self, length: int) -> bool:
        """Whether a context of `length` tokens ends before the next slot."""
        return length <= self.idx

    def make_room(self, length: int) -> None:
        """With no row live: move the next slot on to where a context of `length` tokens fits."""
        if length > self.idx:
            self.idx = bucket(length)

    def select(self, pick: mx.array) -> None:
        """Keep the slots `pick` (in that order)."""
        self.keys = self.keys[:, pick]
        mx.eval(self.keys)  # the old keys go before the values are gathered: 1 + kept / (2 rows) caches (cache_copies)
        self.values = self.values[:, pick]
        self.start = self.start[pick]

    def admits_in_place(self, T: int) -> bool:
        """Whether rows admitted now fit the cache as it is (room for T tokens each): admit_into can take them."""
        return self.in_place and bucket(self.idx + T) <= self.keys.shape[3]

    def prefill_entries(self, entries: list) -> tuple[list, np.ndarray]:
        """The contexts of `entries` (context, first row, rows, kept block or None) prefilled to end at slot idx:
        fresh contexts', then next turns' on their kept blocks (rollout/turns.py). -> ([(keys, values, start,
        logits)] per kind present, as prefill gives them; their rollout rows in that order)."""
        fresh, resumed = [e for e in entries if e[3] is None], [e for e in entries if e[3] is not None]
        parts = [self.prefill([e[0] for e in fresh], [e[2] for e in fresh], self.idx)] if fresh else []
        if resumed:
            if parts:  # one prefill's transients at a time: the fresh blocks are done before the next starts
                mx.eval(parts[0][0], parts[0][1])
            *part, n = prefill_resumed(self.spec, self.prefill_weights, [(e[0], e[3]) for e in resumed], self.idx,
                                       self.pad_id)
            parts.append(part)
            self.prefilled_tokens += n
        return parts, np.concatenate([first + np.arange(n) for _, first, n, _ in fresh + resumed])

    def admit_into(self, slots: np.ndarray, entries: list) -> tuple[mx.array, np.ndarray, np.ndarray]:
        """admit, into slots of the batch whose rows are done (in order, one per admitted row), writing their
        contexts' keys and values into the cache in place (kernels/cache_write.py) instead of copying the whole
        cache. Needs admits_in_place. -> (their logits [rows, V], their rollout rows, the slots they took), in the
        order admit gives them."""
        if len(slots) < sum(e[2] for e in entries):
            raise ValueError(f"{len(slots)} free slots for {sum(e[2] for e in entries)} admitted rows")
        parts, rows = self.prefill_entries(entries)
        taken, used = 0, []
        for block_k, block_v, start, _ in parts:
            part_slots = np.asarray(slots[taken:taken + block_k.shape[1]])
            self.keys, self.values = write_rows(self.keys, self.values, block_k, block_v, part_slots,
                                                self.idx - block_k.shape[3])
            self.start[mx.array(part_slots.astype(np.int32))] = start
            used.append(part_slots)
            taken += block_k.shape[1]
        return mx.concatenate([p[3] for p in parts]), rows, np.concatenate(used)

    def admit(self, entries: list, T: int) -> tuple[mx.array, np.ndarray]:
        """Append the rows of `entries` (context, first row, rows, kept block or None) to the batch: their
        contexts' cache ends at slot idx (the cache grows when idx + T passes its end). -> (their logits
        [rows, V], their rollout rows in that order: fresh contexts', then next turns' on kept blocks). Only
        rows go back: an entry holds its kept block, which holds every row reported at its sync."""
        layers, R, Hkv, S, Dh = self.keys.shape
        parts, rows = self.prefill_entries(entries)
        mx.eval([p[0] for p in parts] + [p[1] for p in parts])  # the prefills' transients go before the new cache comes
        firsts = R + np.concatenate([[0], np.cumsum([p[0].shape[1] for p in parts])])
        shape = (layers, int(firsts[-1]), Hkv, max(S, bucket(self.idx + T)), Dh)
        # the refill's one copy of the cache: the keys go before the values are copied (at most 1.5x the cache, not 2x)
        for name, i in (("keys", 0), ("values", 1)):
            blocks = [(getattr(self, name), 0, 0)] + [(p[i], int(first), self.idx - p[i].shape[3])
                                                        for p, first in zip(parts, firsts)]
            setattr(self, name, placed(shape, blocks))
            mx.eval(getattr(self, name))
        self.start = mx.concatenate([self.start] + [p[2] for p in parts])
        return mx.concatenate([p[3] for p in parts]), rows


def context_rows(counts: list[int]) -> mx.array:
    """Each row's context: context i repeated counts[i] times (a prompt's G samples share its prefill)."""
    return mx.array(np.repeat(np.arange(len(counts)), counts))


def placed(shape: tuple, blocks: list) -> mx.array:
    """A new cache of `shape` [layers, rows, Hkv, capacity, Dh]: zeros, with each of blocks = [(block [layers, n,
    Hkv, W, Dh], first row, first slot)] at its rows and slots. Slice updates, not mx.concatenate (nor mx.pad, which
    copies the same way): on MLX 0.32.4's CUDA backend a concatenation of 8 rows onto a 1,024 x 512-slot cache wrote
    them wrong in every layer that starts past element 2^31 (bench/records/h200-session34-20261128/), where slice
    updates were exact."""
    out = mx.zeros(shape, blocks[0][0].dtype)
    for block, row, slot in blocks:
        out[:, row:row + block.shape[1], :, slot:slot + block.shape[3]] = block
    return out


def cache_copies(first: int, waiting: bool, writes: bool) -> tuple[float, str]:
    """A lower bound on the peak number of the sampling copy's KV caches alive at once, and why, for a running
    batch of `first` rows; waiting: rows wait to join it (later prompts, next turns). writes: its step writes the
    cache in place (decoder.steps_write_cache); otherwise each step writes a new cache while the last step reads
    the old (2x). A refill that rebuilds the batch holds the old values beside the new keys (1.5x, CopyDecoder.admit,
    plus its admitted rows' blocks); a compaction, the kept rows' keys beside the whole cache (CopyDecoder.select:
    rebuilt_rows(first // 2) kept rows at most; no compaction at MIN_ROWS rows or fewer, where only begin's
    gather of each prompt's block into its rows adds a little)."""
    if not writes:
        return 2.0, "as each step writes it anew"
    if waiting:
        return 1.5, "while a refill rebuilds the batch"
    if first <= MIN_ROWS:
        return 1.0, ""
    return 1 + rebuilt_rows(first // 2) / (2 * first), "while the batch is compacted"
