"""Data parallelism over mx.distributed: this process's rank, its share of each batch, and the
collectives the trainer needs (gradient averaging, loss and metric reductions, small Python objects,
rank 0's checkpoint sent to the others on resume).

Processes are started by MLX's launcher (`mlx.launch`), which also sets up the backend (ring over TCP,
MPI, NCCL, JACCL); a process started alone is a world of one and every collective is then a no-op.
Each collective runs under a guard: a peer that died makes MLX raise (ring, MPI), a peer that hangs
(or dies under NCCL, which would wait forever) trips the `distributed_timeout` watchdog, and both end
the process with one line naming the rank(s) it lost, instead of a traceback or a hang.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map

from mlx_grpo.base.console import console
from mlx_grpo.base.errors import UserError
from mlx_grpo.loss import SUM_MAX, SUM_MIN, LossSums

LAUNCH_HINT = "start every rank with MLX's launcher, e.g. `mlx.launch -n 2 -- mlx-grpo train ...` (README)"


@dataclass
class World:
    """The processes of one run. group is None for a single process."""

    group: object | None = None
    rank: int = 0
    size: int = 1
    timeout: float = 0.0  # seconds a collective may wait for the other ranks; 0 = forever

    @property
    def is_main(self) -> bool:
        """Rank 0 writes logs, checkpoints and the progress bar."""
        return self.rank == 0

    def share(self, n: int) -> slice:
        """This rank's contiguous share of n items (n divisible by size): groups never straddle ranks."""
        per = n // self.size
        return slice(self.rank * per, (self.rank + 1) * per)

    def seed(self, seed: int) -> int:
        """A seed for this rank's own random draws (dropout masks, sampled evaluation), derived from the
        run's seed: rank 0 keeps it, so a single process is unchanged; reproducible for a world size."""
        return (seed + self.rank * 1_000_000_007) % 2 ** 63

    def print(self, *args, sep: str = " ") -> None:
        """Console output of the run: rank 0's only, so N ranks don't print N copies; through base.console,
        so a progress bar is redrawn below the line instead of being broken."""
        if self.is_main:
            console(sep.join(map(str, args)))

    def fail(self, message: str):
        """Stop every rank for a problem all of them found: rank 0 reports it, the others leave quietly
        (N copies of one line would bury it)."""
        if self.is_main:
            raise UserError(message)
        time.sleep(1.0)  # mlx.launch stops every rank once one exits: let rank 0 print first
        raise SystemExit(2)

    def _others(self) -> str:
        others = [r for r in range(self.size) if r != self.rank]
        return f"rank {others[0]}" if len(others) == 1 else f"one of ranks {', '.join(map(str, others))}"

    @contextmanager
    def _guard(self, phase: str, timeout: float | None = None):
        """Run the collectives of `phase` (their mx.eval inside): a lost peer becomes a UserError, a
        wait past the timeout ends the process (its thread is stuck in the backend, so it cannot raise)."""
        limit = self.timeout if timeout is None else timeout
        timer = None
        if limit > 0:
            timer = threading.Timer(limit, self._timed_out, (phase, limit))
            timer.daemon = True
            timer.start()
        try:
            yield
        except RuntimeError as exc:
            raise UserError(f"rank {self.rank} of {self.size}: the collective of {phase} failed ({exc}); most "
                            f"likely {self._others()} stopped: its own error, or mlx.launch's 'Node with rank N' "
                            "line, says why") from None
        finally:
            if timer is not None:
                timer.cancel()

    def _timed_out(self, phase: str, limit: float) -> None:
        sys.stdout.flush()
        print(f"mlx-grpo train: error: rank {self.rank} of {self.size}: no answer from {self._others()} for "
              f"{limit:.0f} s during {phase}: that rank died or hangs (raise distributed_timeout if it is only "
              "slow)", file=sys.stderr, flush=True)
        os._exit(1)

    # ------------------------------------------------------------------ collectives
    def gather(self, obj, phase: str, timeout: float | None = None) -> list:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
        with self._guard(phase, timeout):
            sizes = mx.distributed.all_gather(mx.array([data.size], dtype=mx.int32), group=self.group)  # [W]
            mx.eval(sizes)
            sizes = [int(s) for s in sizes.tolist()]
            padded = np.zeros(max(sizes), dtype=np.uint8)
            padded[:data.size] = data
            gathered = mx.distributed.all_gather(mx.array(padded), group=self.group)  # [W * width]
            mx.eval(gathered)
        rows = np.array(gathered).reshape(self.size, max(sizes))
        return [pickle.loads(rows[r, :n].tobytes()) for r, n in enumerate(sizes)]

    def broadcast_arrays(self, arrays: dict | None, phase: str) -> dict:
        """Rank 0's flat {name: array} on every rank (the others pass None): names, shapes and dtypes
        travel pickled, the values through all_sum, to which the others add zeros (exact)."""
        if self.size == 1:
            return arrays
        layout = self.gather([(k, v.shape, str(v.dtype).rpartition(".")[2]) for k, v in arrays.items()]
                             if self.is_main else None, phase)[0]
        out = {}
        with self._guard(phase):
            for name, shape, dtype in layout:
                mine = arrays[name] if self.is_main else mx.zeros(shape, dtype=getattr(mx, dtype))
                out[name] = mx.distributed.all_sum(mine, group=self.group)
                mx.eval(out[name])  # one tensor at a time: no second copy of the whole checkpoint at once
        return out

    def agree(self, error: str | None, phase: str, timeout: float | None = None) -> None:
        """Raise on every rank if any rank found a problem, so none is left waiting in a collective."""
        errors = self.gather(error, phase, timeout)
        bad = [(r, e) for r, e in enumerate(errors) if e]
        if len({e for _, e in bad}) == 1 and len(bad) == self.size:  # the same problem everywhere
            self.fail(bad[0][1])
        if bad:
            self.fail("; ".join(f"rank {r}: {e}" for r, e in bad))

    def average_gradients(self, grads):
        """Mean of every rank's gradient tree (mlx.nn.average_gradients: few large all-reduces)."""
        if self.size == 1:
            return grads
        with self._guard("the gradient all-reduce"):
            grads = nn.average_gradients(grads, group=self.group)
            mx.eval(grads)
        return grads

    def reduce_sums(self, sums: LossSums) -> LossSums:
        """The update's LossSums over all ranks. Each rank's loss is its rows' share times the world size
        (see training/optimization.loss_weights), so the loss is averaged and the counts are summed."""
        if self.size == 1:
            return sums
        names = LossSums._fields
        summed = [n for n in names if n not in SUM_MIN | SUM_MAX]
        totals = mx.stack([getattr(sums, n) for n in summed]).astype(mx.float32)
        with self._guard("the loss reduction"):
            totals = mx.distributed.all_sum(totals, group=self.group)
            # In field order on every rank: iterating the frozensets would follow each process's string
            # hash seed, and the ranks' collectives would pair different fields.
            low = {n: mx.distributed.all_min(getattr(sums, n), group=self.group) for n in names if n in SUM_MIN}
            high = {n: mx.distributed.all_max(getattr(sums, n), group=self.group) for n in names if n in SUM_MAX}
            mx.eval(totals, low, high)
        out = {**{n: totals[i] for i, n in enumerate(summed)}, **low, **high}
        out["loss"] = out["loss"] / self.size
        return LossSums(**out)


def zero_gradients(model: nn.Module):
    """A float32 gradient tree of zeros shaped like the trainable parameters (gradients are summed in
    float32), for a rank with no rows."""
    return tree_map(lambda p: mx.zeros(p.shape, dtype=mx.float32), model.trainable_parameters())


def _launcher_says(names: tuple[str, ...]) -> int | None:
    """The first of these environment variables that a launcher (mlx.launch, MPI, PMI) set to a number."""
    for name in names:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None


def launched_rank() -> int:
    """This process's rank as the launcher's environment says (0 when none set it up), for lines printed
    where no World is at hand (a crash)."""
    rank = _launcher_says(("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"))
    return 0 if rank is None else rank


def _launched_size() -> int:
    """How many processes the launcher's environment says there are (1 when none set it up)."""
    if (size := _launcher_says(("MLX_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"))) is not None:
        return size
    hostfile = os.environ.get("MLX_HOSTFILE", "")
    if hostfile and os.path.isfile(hostfile):
        try:
            hosts = json.loads(open(hostfile).read().strip() or "[]")
        except ValueError:
            return 1
        return len(hosts) if isinstance(hosts, list) else 1
    return 1


def init_world(backend: str, timeout: float) -> World:
    """Join the processes mlx.launch started (backend 'any': whichever it set up), or stand alone."""
    if backend != "any" and not mx.distributed.is_available():
        raise UserError(f"distributed_backend = {backend!r}, but this MLX build has no distributed backend")
    try:
        group = mx.distributed.init(strict=backend != "any", backend=backend)
    except RuntimeError as exc:
        raise UserError(f"distributed_backend = {backend!r} could not start ({exc}); {LAUNCH_HINT}") from None
    if group.size() == 1:
        launched = _launched_size()
        if launched > 1:  # MLX fell back to a world of one: N copies would each train alone, in one run dir
            raise UserError(f"mlx.launch started {launched} processes, but this MLX build cannot join them "
                            f"(distributed_backend = {backend!r}): install MLX with that backend (NCCL needs "
                            "MLX's CUDA build), or launch with another --backend")
        return World(None, 0, 1, timeout)
    return World(group, group.rank(), group.size(), timeout)
