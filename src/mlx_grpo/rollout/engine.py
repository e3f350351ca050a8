"""The rollout engine: the one place that turns prompts into sampled completions (Rollout records).

It owns the sampling copy of the policy (models/decoder.py: fused projections, adapters merged, the
compute dtype), refreshed by the trainer after every optimizer update, and the decode loop over it:
each step is one compiled graph (the model's step plus sampling), the KV cache is written outside it,
and rows that have ended are dropped from the batch once at most half of it is still live (the batch
shrinks to the next power of two, so few shapes are ever compiled). generate_many decodes an update's
batch steps together: the later steps' prompts are prefilled into the slots ended rows free (refill), so
one long row no longer holds a batch step. A row's tokens depend on its own key and context, so which
rows share its batch leaves them unchanged (exactly so on a CPU in float32; see below for a GPU).

Models the copy does not cover (other families, quantized weights: QLoRA bases and
quantize_for_rollouts, whose memory saving the copy would undo), and every model under rollout_engine =
model (the default off CUDA), decode through decode.py's generate_rollout on the model itself.
Compaction and refill change the matmuls' row count, which on a GPU in bfloat16 can move a logit's last
bits: a row's tokens then depend on its key, its context and, at a near-tie, on the batch around it (on the
H100, 89% of rows kept their text when 4 batch steps were refilled rather than decoded one by one); a
resumed run replays the same batches and reproduces the same tokens.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_grpo.models import compiled_decode, decoder
from mlx_grpo.kernels import available as kernel_available
from mlx_grpo.models.forward import bucket
from mlx_grpo.rollout.columns import StopRows, Written, assemble
from mlx_grpo.rollout.rollout_records import Rollout, SamplingParams
from mlx_grpo.rollout.sampler import end_ids, finish_rollout, make_sampler, sample
from mlx_grpo.rollout.decode import check_batch_caches, generate_rollout
from mlx_grpo.rollout.turns import TurnRows, prefill_resumed

# A batch is compacted only down to this many rows: below it a decode step costs the same whatever the rows.
MIN_ROWS = 8


def _quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())


def uses_copy(mode: str, model: nn.Module) -> bool:
    """Whether rollout_engine = mode samples `model` through the sampling copy (auto: on NVIDIA GPUs)."""
    wanted = mode == "copy" or (mode == "auto" and kernel_available())
    return wanted and decoder.supports(model) and not _quantized(model)


def check_rollout_model(mode: str, model: nn.Module) -> str | None:
    """Raise UserError (one line naming the family) when the decode cannot batch the caches this model asks
    for. -> a warning line when rollout_engine = copy was asked for a model the copy does not serve (it then
    decodes on the model itself), else None."""
    check_batch_caches(model)
    if mode != "copy" or uses_copy(mode, model):
        return None
    why = "its weights are quantized" if _quantized(model) else \
        f"model family {getattr(model, 'model_type', type(model).__name__)!r} is not one it serves"
    return (f"rollout_engine = copy serves unquantized {', '.join(sorted(decoder.FAMILIES))} models with full "
            f"attention; {why}: rollouts decode on the model itself (rollout_engine = model)")


class RolloutEngine:
    """Samples rollouts from the policy it was last refreshed with.

    mode: rollout_engine (copy, model or auto: the copy on NVIDIA GPUs). compact: drop ended rows from the
    batch (False: every row decodes to the end, for comparisons). graph: decode_graph, the copy's step with
    fewer primitives (models/compiled_decode.py). keep_turn_cache: a row's next turn prefills only what its
    kept cache lacks (rollout/turns.py); False: its whole context again (for comparisons).
    """

    def __init__(self, tokenizer, *, mode: str = "auto", compact: bool = True, sync_every: int = 8,
                 graph: bool = False, keep_turn_cache: bool = True):
        self.tokenizer = tokenizer
        self.mode = mode
        self.compact = compact
        self.sync_every = sync_every
        self.graph = graph
        self.keep_turn_cache = keep_turn_cache
        self.traces = 0  # times a decode step was traced (compiled): once per batch shape and cache capacity
        self.model = None
        self._copy = None  # (spec, weights), built on first use after each refresh
        self._stale = False
        self._steps = {}
        self.row_steps = 0  # rows x decode steps the last fused rollout computed (what compaction saves)
        self.steps = 0  # decode steps it ran (what refill saves: a step costs about the same at any row count)
        self.prefilled_tokens = 0  # context tokens the last fused rollout prefilled (what kept turn caches save)

    def refresh(self, model: nn.Module) -> "RolloutEngine":
        """Sample from `model`'s current weights from now on. The copy is rebuilt when next needed, so
        several updates between two rollouts (num_iterations > 1) and a resume build it once."""
        self.model = model
        self._copy = None  # free the old copy now: its memory is the new one's
        self._stale = uses_copy(self.mode, model)
        return self

    def _current(self):
        if self._stale:
            # its compute dtype is the embedding's (quantized models never get a copy)
            self._copy = decoder.build(self.model, self.model.model.embed_tokens.weight.dtype)
            if self.graph:  # its matrices stored transposed, as compiled_decode's step reads them
                self._copy = (self._copy[0], compiled_decode.graph_weights(self._copy[1]))
            self._stale = False
        return self._copy

    @property
    def uses_copy(self) -> bool:
        return self._current() is not None

    @property
    def spec(self):
        return self._current()[0]

    @property
    def weights(self) -> dict:
        return self._current()[1]

    def generate(self, prompts: list[list[int]], group_size: int, params: SamplingParams, key: mx.array,
                 prefill_text: str = "", on_stop=None, limits: np.ndarray | None = None) -> Rollout:
        """G completions for each of the B prompts. key: one key (split into the N = B*G row keys) or the row
        keys themselves, [N, 2]. limits [N]: tokens each row may write at most (its columns past that are
        not decoded for it, when the batch goes on for others)."""
        keys = key if key.ndim == 2 else mx.random.split(key, len(prompts) * group_size)
        return self.generate_many([(prompts, keys)], group_size, params, prefill_text, on_stop, limits)[0]

    def generate_many(self, jobs: list[tuple[list[list[int]], mx.array]], group_size: int, params: SamplingParams,
                      prefill_text: str = "", on_stop=None, limits: np.ndarray | None = None,
                      turns=None, on_done=None) -> list[Rollout] | None:
        """The rollouts of several batch steps, jobs = [(prompts, row keys [B*G, 2])], decoded together: the
        first job fills the batch, and when rows end, the next jobs' prompts take their slots (refill), so
        one long row no longer holds a batch step. Each row samples the tokens generate() gives it alone.
        on_stop(row, ids): called during decoding with each row (numbered over all jobs) seen stopped by a
        stop string, and its ids up to the stop; it may be called again for the same row. limits: as
        generate's, over all jobs' rows.

        turns (the sampling copy only; multiturn.py): rows go on in later turns inside this decode. At each
        of the loop's syncs the engine calls turns.ended(row, ids, logprobs, entropies) for every row that
        is done (its end token, a stop string or its limit; the tokens it wrote, which may run past that),
        -> how many of ids its context keeps, or None when its episode ended; and turns.take(n) for the next
        turns of the rows ended at earlier syncs: [(context ids, row key, limit, the row it continues)], rows
        numbered n, n + 1, ..., decoded in freed slots ahead of later prompts (rollout/turns.py). turns.pending()
        says whether any ended row may still go on. Returns None: the turns hold the results.
        on_done(first, done) (not with turns): called at the loop's syncs with done [n] bool, whether rows
        first, ..., first + n - 1 (numbered over all jobs) have ended so far (evaluation's progress bar)."""
        if self.model is None:
            raise RuntimeError("RolloutEngine.generate before refresh(model)")
        if not self.uses_copy:
            if turns is not None:
                raise ValueError("turns need the sampling copy (multiturn.py decodes the model in waves)")
            out, first = [], 0
            for prompts, keys in jobs:
                n = len(prompts) * group_size
                watch = None if on_stop is None else (lambda r, ids, first=first: on_stop(first + r, ids))
                progress = None if on_done is None else partial(on_done, first)
                out.append(generate_rollout(self.model, self.tokenizer, prompts, group_size, params, keys,
                                            prefill_text, sync_every=self.sync_every, on_stop=watch,
                                            limits=None if limits is None else limits[first:first + n],
                                            on_done=progress))
                first += n
            return out
        return self._generate_fused(jobs, group_size, params, prefill_text, on_stop, turns, limits, on_done)

    # ------------------------------------------------------------------ the fused decode loop
    def _step_fn(self, params: SamplingParams, eos: tuple[int, ...], kernel: bool):
        """The compiled decode step for these sampling settings (traced once per batch shape)."""
        spec = self.spec
        shape = (spec.heads, spec.kv_heads, spec.head_dim, spec.scale, spec.eps, spec.qk_norm,
                 None if spec.theta is None else tuple(spec.theta.tolist()))
        cache_key = (params.temperature, params.top_p, params.top_k, params.min_p, eos, kernel, shape, self.graph)
        if cache_key not in self._steps and self.graph:
            self._steps[cache_key] = compiled_decode.make_step(
                self.spec, lambda logits, keys: sample(logits, keys, params), mx.array(list(eos) or [-1], mx.int32),
                kernel, on_trace=self._traced)
        if cache_key not in self._steps:  # a refresh with the same shapes keeps the traced step
            spec, eos_array = self.spec, mx.array(list(eos) or [-1], dtype=mx.int32)

            def step(weights, token, keys, values, offset, start, stop, row_keys, ended):
                self._traced()
                logits, new_k, new_v = decoder.decode_step(spec, weights, token, keys, values, offset, start,
                                                           stop, kernel)
                token, logprob, entropy = sample(logits, row_keys, params)
                ended = ended | (token[:, None] == eos_array[None]).any(axis=1)
                return token, logprob, entropy, ended, new_k, new_v

            self._steps[cache_key] = mx.compile(step)
        return self._steps[cache_key]

    def _traced(self) -> None:
        self.traces += 1

    def _prefill_weights(self) -> dict:
        return compiled_decode.model_layout(self.weights) if self.graph else self.weights

    def _prefill(self, contexts: list[list[int]], counts: list[int], at: int, capacity: int, pad_id: int):
        """Prefill each context into counts[i] rows (a prompt's G samples share one prefill), the contexts
        ending at slot `at` of a [layers, rows, Hkv, capacity, Dh] cache. -> (keys, values, start [rows],
        last logits [rows, V])."""
        spec, weights = self.spec, self._prefill_weights()
        self.prefilled_tokens += sum(len(c) for c in contexts)
        longest = max(len(c) for c in contexts)
        width = max(longest, min(bucket(longest), at))  # bucketed widths: fewer distinct shapes
        padding = mx.array([width - len(c) for c in contexts], dtype=mx.int32)
        tokens = mx.array([[pad_id] * (width - len(c)) + list(c) for c in contexts], dtype=mx.int32)
        logits, keys, values = decoder.prefill(spec, weights, tokens, padding)  # [b, V], [b, Hkv, width, Dh] each
        slots = [(0, 0), (0, 0), (0, 0), (at - width, capacity - at), (0, 0)]
        repeat = mx.array(np.repeat(np.arange(len(contexts)), counts))
        keys = mx.pad(mx.stack(keys), slots)[:, repeat]
        values = mx.pad(mx.stack(values), slots)[:, repeat]
        mx.eval(keys, values)
        return keys, values, (padding + (at - width))[repeat], logits[repeat]

    def _generate_fused(self, jobs, G: int, params: SamplingParams, prefill_text: str, on_stop=None,
                        turns=None, limits: np.ndarray | None = None, on_done=None) -> list[Rollout] | None:
        tokenizer, (spec, weights) = self.tokenizer, self._current()
        eos_ids, pad_id = end_ids(tokenizer, params)
        T = params.max_new_tokens
        sampler = make_sampler(params, mx.array(eos_ids or [-1], dtype=mx.int32))
        step = self._step_fn(params, tuple(eos_ids), decoder.kernel_serves(spec))
        stops = StopRows(tokenizer, params.stop)
        # An entry is a context, the rows it starts and its kept cache: a prompt's G rows, or (turns) one row's
        # next turn. Rollout row r (numbered over all entries) writes its step s's token to column s - join[r].
        entries = [(p, g * G, G, None) for g, p in enumerate(p for job, _ in jobs for p in job)]
        n_rows = len(entries) * G
        state = None if turns is None else TurnRows(turns, self.keep_turn_cache, [len(e[0]) for e in entries], G)
        # every row's T step keys, as generate_rollout splits them: [rows, T, 2]
        all_keys = mx.concatenate([mx.vmap(lambda k: mx.random.split(k, T))(keys) for _, keys in jobs])
        join = np.zeros(n_rows, dtype=np.int64)
        # tokens a row may write (turns: what its budget leaves)
        limit = np.full(n_rows, T, dtype=np.int64) if limits is None else np.minimum(np.asarray(limits), T)
        reported = np.zeros(n_rows, dtype=bool)  # turns: rows already handed to turns.ended
        finished = np.zeros(n_rows, dtype=bool)  # on_done: rows ended so far (compaction drops only ended ones)
        queue = list(range(len(jobs[0][0]), len(entries)))  # entries waiting for free slots
        first = list(range(len(jobs[0][0])))
        idx = bucket(max(len(entries[e][0]) for e in first))  # the slot the next fed token is written to
        self.prefilled_tokens = 0
        keys, values, start, logits = self._prefill([entries[e][0] for e in first], [G] * len(first), idx,
                                                    idx + T, pad_id)
        rows = np.arange(len(first) * G)  # the rollout row of each batch slot (-1: a filler slot)
        target = len(rows)  # refills fill the batch back up to its first size
        token, logprob, entropy, ended = sampler(logits, all_keys[mx.array(rows), 0],
                                                 mx.zeros((len(rows),), mx.bool_))
        kstep = mx.ones((len(rows),), dtype=mx.int32)  # each slot's next step key
        segments, columns, opened = [], ([token], [logprob], [entropy]), 0
        rows_so_far = Written(T)  # the rows' tokens at each sync, for the stop strings and the turns
        self.row_steps, self.steps = len(rows), 0
        s, last = 1, T  # decode steps until every admitted row has T tokens
        slot_rows, slot, slot_at = None, None, -1  # slot: idx as a device array (decode_graph), valid at slot_at
        # with turns, the loop also goes on to the sync that hands the last rows to turns.ended
        while s < last or queue or (turns is not None and (turns.pending() or not reported.all())):
            if s % self.sync_every == 0 or s >= last:  # past `last` every row is done: the queue goes in
                mx.eval(ended)
                if turns is not None:  # next turns of the rows that ended at an earlier sync
                    n_rows, all_keys, join, limit, reported = state.take(entries, queue, n_rows, T, all_keys, join,
                                                                         limit, reported)
                done = np.array(ended) | (rows < 0) | (s - join[np.maximum(rows, 0)] >= limit[np.maximum(rows, 0)])
                # the tokens so far as rows (one host copy per sync, for the stop strings and the turns)
                written = rows_so_far.update(segments + [(rows, opened, columns)], join, n_rows) \
                    if params.stop or turns is not None else None
                if params.stop:
                    done |= stops.stopped(written[0], written[3], rows, on_stop)
                if on_done is not None:
                    finished[rows[done & (rows >= 0)]] = True
                    on_done(0, finished)
                if turns is not None:
                    state.report(written, rows, done, reported, keys, values, start)
                    if done.all() and not queue and turns.pending():  # nothing else to decode: wait for them
                        n_rows, all_keys, join, limit, reported = state.take(entries, queue, n_rows, T, all_keys,
                                                                             join, limit, reported)
                if done.all() and not queue:
                    break
                live = np.flatnonzero(~done)
                admit = []  # refill once enough of the batch is free (each refill copies the cache once)
                if queue and not len(live) and len(entries[queue[0]][0]) > idx:
                    idx = bucket(len(entries[queue[0]][0]))  # nothing live: skip ahead to slots its context fits in
                # a prompt's group waits for a quarter of the batch; a row's next turn for an eighth
                wanted = max(G, target // 4) if queue and entries[queue[0]][2] > 1 else max(1, target // 8)
                if queue and (target - len(live) >= wanted or not len(live)):
                    free = target - len(live)
                    while queue and entries[queue[0]][2] <= free and len(entries[queue[0]][0]) <= idx:
                        free -= entries[queue[0]][2]
                        admit.append(queue.pop(0))
                if admit or (self.compact and len(rows) > MIN_ROWS and len(live) <= len(rows) // 2):
                    segments.append((rows, opened, columns))
                    opened, columns = s, ([], [], [])
                    size = len(live) + sum(entries[e][2] for e in admit)
                    fill = max(MIN_ROWS, 1 << int(np.ceil(np.log2(max(size, 1))))) - size
                    spare = np.flatnonzero(done)
                    keep = np.concatenate([live, spare[:fill], np.zeros(max(0, fill - len(spare)), np.int64)])
                    new_rows = np.concatenate([rows[live], np.full(len(keep) - len(live), -1)])
                    pick = mx.array(keep)
                    keys = keys[:, pick]
                    mx.eval(keys)  # the old keys go before the values are gathered: at most 1.25x the cache
                    values = values[:, pick]
                    start, token, kstep = start[pick], token[pick], kstep[pick]
                    ended = mx.where(mx.array(new_rows >= 0), ended[pick], True)
                    if admit:
                        keys, values, start, token, ended, kstep, new_rows = self._refill(
                            [entries[e] for e in admit], idx, T, pad_id, keys, values, start, token, ended, kstep,
                            new_rows, all_keys, sampler, join, s, segments)
                        for e in admit:  # a kept block is in the batch now: its own copy goes
                            entries[e] = (*entries[e][:3], None)
                        last = max(last, s - 1 + T)
                    rows, slot_rows = new_rows, None
            if slot_rows is None or len(slot_rows) != len(rows):  # after a rebuild: the slots' rows on the device
                slot_rows = mx.array(np.maximum(rows, 0))
            row_keys = all_keys[slot_rows, mx.minimum(kstep, T - 1)]
            if self.graph:  # the slot stays on the device; the graph advances it
                if slot_at != idx:
                    slot = mx.array([idx], dtype=mx.int32)
                token, logprob, entropy, ended, new_k, new_v, next_slot, kstep = step(
                    weights, token, keys, values, slot, start, kstep, row_keys, ended)
                slot, slot_at = next_slot, idx + 1
            else:
                token, logprob, entropy, ended, new_k, new_v = step(weights, token, keys, values, idx - start, start,
                                                                    mx.array([idx], dtype=mx.int32), row_keys, ended)
                kstep = kstep + 1
            # Both steps: a static slice, outside the compiled graph, is written in place; an array offset
            # (or a write inside the graph) copied the whole cache on CUDA (compiled_decode.py).
            keys[..., idx:idx + 1, :] = new_k
            values[..., idx:idx + 1, :] = new_v
            idx, s = idx + 1, s + 1
            self.row_steps += len(rows)
            self.steps += 1
            for column, value in zip(columns, (token, logprob, entropy)):
                column.append(value)
            mx.async_eval(token, logprob, entropy, ended)
        if turns is not None:
            return None
        segments.append((rows, opened, columns))
        ids, lps, ents, filled = assemble(segments, join, n_rows, T, pad_id)
        out, row = [], 0
        for job, _ in jobs:
            n = len(job) * G
            width = max(1, int(filled[row:row + n].max()))
            out.append(finish_rollout(tokenizer, job, mx.array(ids[row:row + n, :width]),
                                      mx.array(lps[row:row + n, :width]), mx.array(ents[row:row + n, :width]),
                                      eos_ids, pad_id, params, G, prefill_text))
            row += n
        return out

    def _refill(self, admit, idx, T, pad_id, keys, values, start, token, ended, kstep, rows,
                all_keys, sampler, join, s, segments):
        """Append the rows of the `admit` entries to the batch: their contexts' cache ends at slot idx (the
        cache grows when idx + T passes its end) and their first token is sampled from the prefill."""
        capacity = max(keys.shape[3], bucket(idx + T))
        if capacity > keys.shape[3]:
            grow = [(0, 0), (0, 0), (0, 0), (0, capacity - keys.shape[3]), (0, 0)]
            keys, values = mx.pad(keys, grow), mx.pad(values, grow)
        fresh, resumed = [e for e in admit if e[3] is None], [e for e in admit if e[3] is not None]
        parts = [self._prefill([e[0] for e in fresh], [e[2] for e in fresh], idx, capacity, pad_id)] if fresh else []
        if resumed:  # next turns on their kept caches (rollout/turns.py)
            *part, n = prefill_resumed(self.spec, self._prefill_weights(), [(e[0], e[3]) for e in resumed], idx,
                                       capacity, pad_id)
            parts.append(part)
            self.prefilled_tokens += n
        new_start, logits = (mx.concatenate([p[i] for p in parts]) for i in (2, 3))
        added = np.concatenate([first + np.arange(n) for _, first, n, _ in fresh + resumed])
        first_token, logprob, entropy, first_ended = sampler(logits, all_keys[mx.array(added), 0],
                                                             mx.zeros((len(added),), mx.bool_))
        join[added] = s - 1  # their first token sits in the column before this step's
        segments.append((added, s - 1, ([first_token], [logprob], [entropy])))
        keys = mx.concatenate([keys] + [p[0] for p in parts], axis=1)  # the refill's one copy of the cache
        values = mx.concatenate([values] + [p[1] for p in parts], axis=1)
        mx.eval(keys, values)
        return (keys, values, mx.concatenate([start, new_start]), mx.concatenate([token, first_token]),
                mx.concatenate([ended, first_ended]), mx.concatenate([kstep, mx.ones((len(added),), mx.int32)]),
                np.concatenate([rows, added]))
