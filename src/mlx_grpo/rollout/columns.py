"""The decode loop's output as rows (loop.py): each decode step appends one column per batch slot (its
token, log-prob and entropy), in segments between two rebuilds of the batch; a slot's step goes to its row's
column step - join[row]. `assemble` scatters every segment back to rows once, for the rollout's records;
`Written` keeps the rows between the loop's syncs and converts only the columns decoded since the last one,
where assembling again at every sync cost time that grew with the rollout's length (session 26's profile of a
tool-calling rollout: 0.76 s of 5.6 s). `StopRows` finds the rows that wrote a stop string from those rows with
sampler.StopScanner, each row's cut looked for only when a caller needs it (the same profile: 0.51 s in stop
checks, mostly whole rows decoded again to find where a stop string that was already known to be there ends),
and with sampler.closing_tokens' table decodes only rows whose new tokens can have completed one (session 39).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_grpo.rollout.sampler import StopScanner


def _scatter(out: tuple, first: int, rows: np.ndarray, join: np.ndarray, parts: tuple, offset: int, T: int,
             on_host: bool = False) -> None:
    """Write columns offset, offset + 1, ... of one segment (parts: token, log-prob, entropy columns, each a
    list of [slots] arrays) into out = (ids, log-probs, entropies, filled). on_host: stack the columns on the
    host (a stack on the device would wait for every step queued after them: the loop's lookahead); otherwise
    on the device, one host copy per part (on CUDA each array read on the host is first moved to host-visible
    memory: one move per part, not per column)."""
    ids, lps, ents, filled = out
    real = np.flatnonzero(rows >= 0)
    r = rows[real]
    cols = first + offset - join[r][:, None] + np.arange(len(parts[0]))[None, :]  # [slots, steps]
    ok = (cols >= 0) & (cols < T)
    rr = np.broadcast_to(r[:, None], cols.shape)
    for target, part in zip((ids, lps, ents), parts):
        stacked = np.stack([np.array(c) for c in part], axis=1) if on_host else np.array(mx.stack(part, axis=1))
        target[rr[ok], cols[ok]] = stacked[real][ok]
    np.maximum.at(filled, rr[ok], cols[ok] + 1)


def assemble(segments, join: np.ndarray, n_rows: int, T: int, pad_id: int):
    """Scatter the segments [(slot rows, first step, (tokens, log-probs, entropies))] back to rollout rows:
    -> ids, log-probs, entropies as numpy [rows, T] (pad_id / 0 where a row wrote nothing) and each row's
    number of columns written."""
    out = (np.full((n_rows, T), pad_id, dtype=np.int32), np.zeros((n_rows, T), dtype=np.float32),
           np.zeros((n_rows, T), dtype=np.float32), np.zeros(n_rows, dtype=np.int64))
    for rows, first, parts in segments:
        if parts[0]:
            _scatter(out, first, rows, join, parts, 0, T)
    return out


class Written:
    """`assemble(segments, join, n_rows, T, -1)` kept up to date across one decode loop's syncs. A segment's
    column lists only grow (the open one) or stop growing (closed ones), and a row's join is fixed once it
    has written anything, so the columns already scattered never change."""

    def __init__(self, T: int):
        self.T = T
        self.out = assemble([], np.zeros(0, np.int64), 0, T, -1)
        self.seen: dict[int, int] = {}  # id of a segment's token list -> columns scattered (the lists stay alive)

    def update(self, segments, join: np.ndarray, n_rows: int, hold: int = 0):
        """-> assemble(segments, join, n_rows, T, -1): the rows as numpy arrays, owned by this object. hold: the
        last segment's last `hold` columns are left out (still on the device: the loop's lookahead), taken at a
        later update."""
        grow = n_rows - len(self.out[3])
        if grow > 0:  # rows the turns added since the last sync
            self.out = tuple(np.concatenate([a, np.full((grow,) + a.shape[1:], -1 if i == 0 else 0, a.dtype)])
                             for i, a in enumerate(self.out))
        for i, (rows, first, parts) in enumerate(segments):
            done, end = self.seen.get(id(parts[0]), 0), len(parts[0]) - (hold if i == len(segments) - 1 else 0)
            if done < end:
                _scatter(self.out, first, rows, join, tuple(p[done:end] for p in parts), done, self.T, hold > 0)
                self.seen[id(parts[0])] = end
        return self.out


class StopRows:
    """Which rows have written a stop string, sync after sync of one decode loop (loop.py): StopScanner's test
    on Written's rows (a row with no new token is not decoded again, a row already ended is not decoded at all),
    and a row seen stopped stays stopped (its text only grows). The cut (StopScanner.first_stop) is looked
    for only for on_stop, once per row: the first stop string of a row that only grows does not move. With a
    closing-token table (sampler.closing_tokens), only rows that wrote one of its tokens since they were last
    cleared (or have a gap: a column never written) are decoded at all."""

    def __init__(self, tokenizer, stops: tuple[str, ...], closing: np.ndarray | None = None):
        self.scanner = StopScanner(tokenizer, stops)
        self.found: set[int] = set()
        # sampler.closing_tokens' table: a row whose new tokens hold none of them is not decoded (most rows at
        # most syncs: a tool call's closing tag writes the rows' only ">"); None: every row with new tokens is decoded
        self.closing = closing
        self.checked = np.zeros(0, np.int64)  # per row: its tokens the table has cleared
        self.gapped = np.zeros(0, bool)  # per row: a column inside its filled ones was seen unwritten (always decoded)

    def stopped(self, ids: np.ndarray, filled: np.ndarray, rows: np.ndarray, on_stop=None,
                ended: np.ndarray | None = None) -> np.ndarray:
        """Which batch slots' rows (rows [slots], -1: a filler, which counts as stopped) have generated a stop
        string so far, from Written's ids [rows, T] (-1 where unwritten) and filled [rows]; slots ended [slots]
        (an end token, a limit) count as stopped and are not scanned. on_stop(row, its ids up to the stop)
        hears of each row at the first call that sees its stop string."""
        out = np.ones(len(rows), dtype=bool)
        todo = [slot for slot, r in enumerate(rows.tolist())
                if r >= 0 and r not in self.found and not (ended is not None and ended[slot])]
        if self.closing is not None and todo:
            todo = self._may_stop(ids, filled, rows, np.array(todo), out)
        for slot in todo:
            r = int(rows[slot])
            row = ids[r, :filled[r]]
            if row.size and row.min() < 0:  # a gap (never seen): the row's written tokens, as a whole scan takes them
                row = row[row >= 0]
            whole = row.tolist()
            if not self.scanner.stopped(r, whole):
                out[slot] = False
                continue
            self.found.add(r)
            if on_stop is not None:
                on_stop(r, whole[:self.scanner.first_stop(whole)])  # the stop is there: no whole-text check again
        return out

    def _may_stop(self, ids: np.ndarray, filled: np.ndarray, rows: np.ndarray, slots: np.ndarray,
                  out: np.ndarray) -> list[int]:
        """Of `slots`, those whose rows wrote a closing token since they were last cleared (or have a gap):
        the others are marked not stopped in `out`, and clean up to their filled columns, in one pass over
        the batch's columns."""
        if len(self.checked) < len(ids):
            grow = len(ids) - len(self.checked)
            self.checked = np.concatenate([self.checked, np.zeros(grow, np.int64)])
            self.gapped = np.concatenate([self.gapped, np.zeros(grow, bool)])
        r, n = rows[slots], filled[rows[slots]]
        lo = int(self.checked[r].min())
        hi = max(int(n.max()), lo)
        sub = ids[r, lo:hi]  # the columns new to some row: what a sync reads does not grow with the rows' lengths
        cols = np.arange(lo, hi)[None, :]
        new = (cols >= self.checked[r][:, None]) & (cols < n[:, None])
        self.gapped[r] |= ((sub < 0) & new).any(axis=1)  # a gap: the row is scanned as before from then on
        hit = (self.closing[np.clip(sub, -1, len(self.closing) - 2)] & new).any(axis=1) | self.gapped[r]
        self.checked[r] = np.maximum(self.checked[r], n)
        out[slots[~hit]] = False
        for row, k in zip(r[~hit].tolist(), n[~hit].tolist()):
            self.scanner.mark_clean(row, k)
        return slots[hit].tolist()
