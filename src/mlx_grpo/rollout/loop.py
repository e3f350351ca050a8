"""The one decode loop of text rollouts (issue 46): from the prefill's logits, step the batch, sample each row with its
own key per step, sync every few steps (rows ended by an end token, a stop string or their limit; the callers'
progress and stop hooks; multi-turn hand-offs), and assemble the columns back to rows (columns.assemble).

What decodes is a decoder object, composed in, not subclassed: `step(token, row_keys, kstep, ended, sampler)` ->
(token, logprob, entropy, ended, kstep) feeds one token per batch slot through the model and samples the next.
`ModelDecoder` below is a model's forward on caches it keeps itself (decode.generate_rollout on mlx-lm's caches
or the static cache; vlm/image_rollout.py with its positions and mask): a batch fixed from prefill to end.
copy_decoder.CopyDecoder is the engine's sampling copy on its own static KV cache, whose `refills` says it can
also reshape the batch between steps: `select(pick)` keeps some slots (compaction), `admit(entries)` prefills
new rows into the batch (refill, next turns on their kept blocks), `admits_in_place` / `admit_into(slots, entries)`
prefill them into the slots of done rows instead (the batch keeps its size; no copy of the cache), `fits` /
`make_room` place a context in the cache, and `cache` hands the turns their KV blocks. Compaction, refill and
turns need a decoder that refills. The copy's cache is written behind MLX's back (kernels/cache_write.py): every
read of it here is evaluated, or at least queued (the turns' blocks with lookahead), before a refill writes it.

A row's step-t key is its row key split T ways, entry t, whichever slot it decodes in and whatever rows share
its batch; a row that joins later writes its step s's token to column s - join[row].
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlx_grpo.models.forward import row_bucket
from mlx_grpo.rollout.columns import StopRows, Written, assemble
from mlx_grpo.rollout.rollout_records import Rollout, SamplingParams
from mlx_grpo.rollout.sampler import finish_rollout, make_sampler

# A batch is compacted only down to this many rows: below it a decode step costs the same whatever the rows.
MIN_ROWS = 8


def check_lookahead(lookahead: int, sync_every: int) -> None:
    """A sync looks back at most to the one before it: lookahead from 0 to sync_every - 1 (decode_rows)."""
    if not 0 <= lookahead < sync_every:
        raise ValueError(f"lookahead {lookahead}: from 0 to sync_every - 1 ({sync_every - 1})")


def rebuilt_rows(rows: int) -> int:
    """The rows a rebuilt batch of `rows` live and admitted rows is padded to: the next power of two, at least
    MIN_ROWS (few shapes are ever compiled). A batch never outgrows rebuilt_rows of its first rows: refills
    admit only into the room the first rows leave."""
    return max(MIN_ROWS, row_bucket(rows))


class ModelDecoder:
    """forward(tokens [N, 1], cache=caches) -> logits [N, 1, V]: a model's step on caches it writes itself. Its
    batch stays as the prefill made it (no compaction, refill or turns)."""

    refills = False

    def __init__(self, forward, caches):
        self.forward, self.caches = forward, caches

    def step(self, token, row_keys, kstep, ended, sampler):
        logits = self.forward(token[:, None], cache=self.caches)[:, -1, :]
        token, logprob, entropy, ended = sampler(logits, row_keys, ended)
        return token, logprob, entropy, ended, kstep + 1


def sample_rows(sampler, logits: mx.array, all_keys: mx.array, added: np.ndarray):
    """sampler's first tokens of the admitted rows `added` (logits [n, V]; all_keys [rows, T, 2]: each row's step
    keys), its compiled graph run on row_bucket(n) rows (the first row repeated; each row samples alone) so that
    refills trace few shapes. -> (token, logprob, entropy, ended) [row_bucket(n)]: the first n are the rows'
    (the padding taken in one gather each, not sliced off after: fewer operations per admission)."""
    pad = np.concatenate([np.arange(len(added)), np.zeros(row_bucket(len(added)) - len(added), np.int64)])
    return sampler(logits[mx.array(pad)], all_keys[mx.array(added[pad]), 0], mx.zeros((len(pad),), mx.bool_))


@dataclass(frozen=True)
class Decoded:
    """decode_rows' result: ids, log-probs, entropies [rows, T] (pad / 0 where a row wrote nothing; None when
    turns hold the results), columns each row wrote [rows], rows x decode steps and decode steps computed."""

    ids: np.ndarray | None
    logprobs: np.ndarray | None
    entropies: np.ndarray | None
    filled: np.ndarray | None
    row_steps: int
    steps: int


def decode_rows(decoder, logits: mx.array, row_keys: mx.array, params: SamplingParams, tokenizer,
                eos_ids: list[int], pad_id: int, sync_every: int, *, entries: list | None = None,
                compact: bool = False, limits: np.ndarray | None = None, on_stop=None, on_done=None,
                turns=None, closing: np.ndarray | None = None, turn_wait: int = 8, lookahead: int = 0) -> Decoded:
    """Decode rows 0..N-1 from their prefill logits [N, V] (a batch's first rows) to their end; row_keys [rows, 2]
    are every row's key, rows N.. waiting as `entries`. entries: (context, first row, rows, kept turn block or
    None) per context, in row order, those past the first N admitted in freed slots (refill). compact: drop
    ended rows once at most half the batch is live. limits [rows]: tokens each row may write. on_stop(row, ids):
    called once per row, at the first sync that sees it stopped by a stop string (rows ended by an end
    token or their limit are not scanned), with its ids up to the stop. on_done(finished):
    called at syncs with [rows] bool, the rows ended so far. turns: a turns.TurnRows, rows going on in later
    turns inside this decode (their rows appended to entries and row_keys). closing: sampler.closing_tokens'
    table for params.stop (rows that wrote none of its tokens are not decoded for stop strings). turn_wait: one-row
    entries (next turns, prompts of one sample) wait until target // turn_wait slots are free, at least one (the
    batch's first size: fewer, larger admissions against rows idle longer). lookahead (below sync_every): a sync
    before `last` reads the rows as they were that many steps before it, so that its host work (stop checks,
    turns, refill) can run while the last steps are still on the device; rows that ended in them are seen at the
    next sync (the same tokens, later admissions; the columns a row writes past its limit, which callers cut,
    depend on when it is dropped, as they do on sync_every)."""
    entries = [] if entries is None else entries
    check_lookahead(lookahead, sync_every)
    T, N = params.max_new_tokens, logits.shape[0]
    if (compact or turns is not None or any(e[1] >= N for e in entries)) and not decoder.refills:
        raise ValueError(f"{type(decoder).__name__} cannot compact, refill or take turns")
    rows_wanted = max((e[1] + e[2] for e in entries), default=N)
    if len(row_keys) != rows_wanted:  # a gather past the keys would read garbage, not fail
        raise ValueError(f"{len(row_keys)} row keys for {rows_wanted} rows: one key per row")
    sampler = make_sampler(params, mx.array(eos_ids or [-1], dtype=mx.int32))
    stops = StopRows(tokenizer, params.stop, closing)
    n_rows = len(row_keys)
    all_keys = mx.vmap(lambda k: mx.random.split(k, T))(row_keys)  # every row's T step keys: [rows, T, 2]
    join = np.zeros(n_rows, dtype=np.int64)
    # tokens a row may write (turns: what its budget leaves)
    limit = np.full(n_rows, T, dtype=np.int64) if limits is None else np.minimum(np.asarray(limits), T)
    reported = np.zeros(n_rows, dtype=bool)  # turns: rows already handed to turns.ended
    finished = np.zeros(n_rows, dtype=bool)  # on_done: rows ended so far (compaction drops only ended ones)
    queue = [e for e, entry in enumerate(entries) if entry[1] >= N]  # entries waiting for free slots
    rows = np.arange(N)  # the rollout row of each batch slot (-1: a filler slot)
    target = N  # refills fill the batch back up to its first size
    token, logprob, entropy, ended = sampler(logits, all_keys[mx.array(rows), 0], mx.zeros((N,), mx.bool_))
    del logits  # the prefill's [N, V]: not held through the decode
    history = deque([ended], maxlen=lookahead + 1)  # `ended` after each of the last steps since the batch changed
    kstep = mx.ones((N,), dtype=mx.int32)  # each slot's next step key
    segments, columns, opened = [], ([token], [logprob], [entropy]), 0
    rows_so_far = Written(T)  # the rows' tokens at each sync, for the stop strings and the turns
    row_steps, steps = N, 0
    s, last = 1, T  # decode steps until every admitted row has T tokens
    slot_rows = None
    # with turns, the loop also goes on to the sync that hands the last rows to turns.ended
    while s < last or queue or (turns is not None and (turns.pending() or not reported.all())):
        if s % sync_every == 0 or s >= last:  # past `last` every row is done: the queue goes in
            # the rows as of `lag` steps ago (history[0]) while the last steps run; all of them past `last`, and at
            # the first sync after a batch change fewer than lookahead steps before (a refill past `last`)
            lag = lookahead if s < last and len(history) > lookahead else 0
            seen = history[0] if lag else ended
            mx.eval(seen)
            if turns is not None:  # next turns of the rows that ended at an earlier sync
                n_rows, all_keys, join, limit, reported = turns.take(entries, queue, n_rows, T, all_keys, join,
                                                                     limit, reported)
            done = np.array(seen) | (rows < 0) | (s - lag - join[np.maximum(rows, 0)] >= limit[np.maximum(rows, 0)])
            # the tokens so far as rows (one host copy per sync, for the stop strings and the turns)
            written = rows_so_far.update(segments + [(rows, opened, columns)], join, n_rows, lag) \
                if params.stop or turns is not None else None
            if params.stop:
                done |= stops.stopped(written[0], written[3], rows, on_stop, ended=done)
            if on_done is not None:
                finished[rows[done & (rows >= 0)]] = True
                on_done(finished)
            if turns is not None:
                turns.report(written, rows, done, reported, *decoder.cache)
                # answers that take microseconds (a calculator), or nothing else to decode: wait for them now, so
                # the next turns can join at this sync's refill
                if turns.pending() and (turns.at_once or (done.all() and not queue)):
                    n_rows, all_keys, join, limit, reported = turns.take(entries, queue, n_rows, T, all_keys, join,
                                                                         limit, reported)
            if done.all() and not queue:
                break
            live = np.flatnonzero(~done)
            admit = []  # refill once enough of the batch is free (a rebuilt batch copies the cache once)
            if queue and not len(live):
                decoder.make_room(len(entries[queue[0]][0]))  # nothing live: skip ahead to where it fits
            # a prompt's group waits for a quarter of the batch; a single row (a next turn) for 1/turn_wait of it
            wanted = max(entries[queue[0]][2], target // 4) if queue and entries[queue[0]][2] > 1 \
                else max(1, target // turn_wait)
            if queue and (target - len(live) >= wanted or not len(live)):
                free = target - len(live)
                while queue and entries[queue[0]][2] <= free and decoder.fits(len(entries[queue[0]][0])):
                    free -= entries[queue[0]][2]
                    admit.append(queue.pop(0))
            if admit or (compact and len(rows) > MIN_ROWS and len(live) <= len(rows) // 2):
                segments.append((rows, opened, columns))
                opened, columns = s, ([], [], [])
                size = len(live) + sum(entries[e][2] for e in admit)
                fill = rebuilt_rows(size) - size
                # the batch keeps its size: the rows taken go into the slots of rows that are done, written in
                # place (no copy of the cache); otherwise the batch is rebuilt (compacted, the rows appended)
                in_place = bool(admit) and size + fill == len(rows) and decoder.admits_in_place(T)
                if in_place:
                    logits, added, taken = decoder.admit_into(np.flatnonzero(done), [entries[e] for e in admit])
                    rows = np.where(done, -1, rows)
                    rows[taken] = added
                else:
                    spare = np.flatnonzero(done)
                    keep = np.concatenate([live, spare[:fill], np.zeros(max(0, fill - len(spare)), np.int64)])
                    rows = np.concatenate([rows[live], np.full(len(keep) - len(live), -1)])
                    pick = mx.array(keep)
                    decoder.select(pick)
                    token, kstep = token[pick], kstep[pick]
                    ended = mx.where(mx.array(rows >= 0), ended[pick], True)
                    if admit:
                        logits, added = decoder.admit([entries[e] for e in admit], T)
                if admit:
                    first_token, logprob, entropy, first_ended = sample_rows(sampler, logits, all_keys, added)
                    del logits  # [admitted rows, V]: not held till the next refill
                    join[added] = s - 1  # their first token sits in the column before this step's
                    padded = np.concatenate([added, np.full(len(first_token) - len(added), -1)])  # -1: fillers
                    segments.append((padded, s - 1, ([first_token], [logprob], [entropy])))
                    if in_place:  # functional updates (the columns hold the old token arrays): one gather each
                        width, new = len(rows), np.isin(np.arange(len(rows)), taken)
                        src = np.arange(width)  # a slot's own entry, or its admitted row's after the old ones
                        src[taken] = width + np.arange(len(taken))
                        token = mx.concatenate([token, first_token])[mx.array(src)]
                        # a slot left without a row has ended (the last entry)
                        src[rows < 0] = width + len(first_token)
                        ended = mx.concatenate([ended, first_ended, mx.ones((1,), mx.bool_)])[mx.array(src)]
                        kstep = mx.where(mx.array(new), 1, kstep)
                    else:
                        first_token, first_ended = first_token[:len(added)], first_ended[:len(added)]
                        token, ended = mx.concatenate([token, first_token]), mx.concatenate([ended, first_ended])
                        kstep = mx.concatenate([kstep, mx.ones((len(added),), mx.int32)])
                        rows = np.concatenate([rows, added])
                    for e in admit:  # a kept block is in the batch now: its own copy goes
                        entries[e] = (*entries[e][:3], None)
                    last = max(last, s - 1 + T)
                slot_rows = None
                history = deque([ended], maxlen=lookahead + 1)
        if slot_rows is None or len(slot_rows) != len(rows):  # after a rebuild: the slots' rows on the device
            slot_rows = mx.array(np.maximum(rows, 0))
        row_keys = all_keys[slot_rows, mx.minimum(kstep, T - 1)]
        token, logprob, entropy, ended, kstep = decoder.step(token, row_keys, kstep, ended, sampler)
        history.append(ended)
        s += 1
        row_steps += len(rows)
        steps += 1
        for column, value in zip(columns, (token, logprob, entropy)):
            column.append(value)
        mx.async_eval(token, logprob, entropy, ended)
    if turns is not None:
        return Decoded(None, None, None, None, row_steps, steps)
    segments.append((rows, opened, columns))
    return Decoded(*assemble(segments, join, n_rows, T, pad_id), row_steps, steps)


def finish_rows(tokenizer, prompt_sets: list[list[list[int]]], group_size: int, decoded: Decoded,
                eos_ids: list[int], pad_id: int, params: SamplingParams, prefill_text: str) -> list[Rollout]:
    """One Rollout per set of prompts (a batch step's), from their rows of decoded in order: each cut to the
    columns its rows wrote, then at each row's end (sampler.finish_rollout)."""
    out, row = [], 0
    for prompts in prompt_sets:
        n = len(prompts) * group_size
        width = max(1, int(decoded.filled[row:row + n].max()))
        out.append(finish_rollout(tokenizer, prompts, *(mx.array(a[row:row + n, :width]) for a in
                                                        (decoded.ids, decoded.logprobs, decoded.entropies)),
                                  eos_ids, pad_id, params, group_size, prefill_text))
        row += n
    return out
