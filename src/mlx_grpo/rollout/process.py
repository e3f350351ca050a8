"""rollout_worker = "process": async_rollouts' rollouts decode in a process of their own.

In one process the rollout's decode (host-bound) and the training pass slow each other about as much as
they overlap; in two processes the same GPU did 1.44x the work in the same time (docs/benchmarks-history.md,
ninth sitting). RolloutProcess owns that second process (worker_entry.py starts it, worker.py serves in it): the
model (structure and weights) and the tokenizer are pickled to it once; before each job the trainable
weights to sample from are copied into a file both processes map (in /dev/shm where it has room: pickling
them through the pipe cost ~0.5 s an update for SmolLM2-135M), and the job carries the batch steps'
prompts and row keys; the Rollout records come back. Nothing else crosses: the draw, the rewards and the
checkpoints stay in the training process (training/prefetch.py), so the thread and the process share one
schedule and one resume.

The worker ignores Ctrl-C (the training process decides), exits when the training process is gone however
it ended (worker_entry.py watches it), and removes the weights file as soon as it has mapped it.
"""

from __future__ import annotations

import mmap
import os
import pickle
import signal
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlx_grpo.base.errors import UserError
from mlx_grpo.rollout.rollout_records import Rollout, SamplingParams
from mlx_grpo.rollout.worker import dtype_name, limit_cache, weight_layout
from mlx_grpo.rollout.worker_entry import start_worker

STOP_WAIT_S = 10.0  # how long a worker told to stop may take before it is killed
WORKER = "the rollout process (rollout_worker = process)"


def weights_file(size: int) -> str:
    """A file of `size` bytes with its blocks allocated (a sparse file on a full tmpfs kills whoever writes
    to it with SIGBUS): in /dev/shm, else (no /dev/shm, or no room or no access there: Docker's is 64 MB) the
    temp folder."""
    failed = []
    for folder in [d for d in ("/dev/shm",) if Path(d).is_dir()] + [tempfile.gettempdir()]:
        path = None
        try:
            fd, path = tempfile.mkstemp(prefix="mlx-grpo-weights-", dir=folder)
            try:
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, size)
                else:  # macOS: a file in the temp folder, on disk
                    os.ftruncate(fd, size)
            finally:
                os.close(fd)
            return path
        except OSError as exc:
            if path is not None:
                Path(path).unlink(missing_ok=True)
            failed.append(f"{folder} ({exc.strerror or exc})")
    raise UserError(f"rollout_worker = process shares the trainable weights ({size / 1e6:.0f} MB) with the rollout "
                    f"process through a file, and none could be made: {'; '.join(failed)} (in Docker: --shm-size): "
                    "free some room, or set rollout_worker = thread")


def raise_worker_error(kind: str, message: str, trace: str) -> None:
    """The worker's exception, raised here: its message first (errors.out_of_memory reads a failed allocation
    from the first line, and this file's place in rollout/ names the phase), its traceback after."""
    text = f"{message}\n\n{WORKER} failed with {kind}; its traceback:\n{trace}"
    raise (MemoryError if kind == "MemoryError" else RuntimeError)(text)


class RolloutProcess:
    """The training process's side: the constructor starts the worker, sample() (blocking; prefetch.py's
    thread calls it), stop(). model, tokenizer: the trainer's (pickled once); mode, graph, rows: rollout_engine,
    decode_graph and running_rows."""

    def __init__(self, model, tokenizer, mode: str, graph: bool, rows: int = 0):
        self.layout = weight_layout(dict(tree_flatten(model.trainable_parameters())))
        size = max([at + n for at, n, _, _ in self.layout.values()], default=0) or 1  # where the last tensor ends
        try:
            self.payload = pickle.dumps((model, tokenizer, mode, graph, rows, self.layout), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise UserError(f"rollout_worker = process sends the model to a second process and cannot pickle it "
                            f"({type(exc).__name__}: {exc}): set rollout_worker = thread") from None
        self.path = weights_file(size)
        try:
            with open(self.path, "r+b") as f:
                self.shared = mmap.mmap(f.fileno(), size)
            self.conn, self.process = start_worker(self.path)
        except BaseException:
            Path(self.path).unlink(missing_ok=True)
            raise
        self.cache_before = limit_cache()

    def sample(self, weights: dict, jobs: list[tuple[list[list[int]], mx.array]], group_size: int,
               params: SamplingParams, prefill: str) -> tuple[list[Rollout], float]:
        """The rollouts of `jobs` (generate_many's) sampled from `weights` (a parameter tree with every
        trainable tensor; only those travel, the rest never change), and the seconds the worker took. The
        worker is idle here (one job at a time), so the shared file is free to write."""
        flat = dict(tree_flatten(weights))
        view = data = np.frombuffer(self.shared, dtype=np.uint8)
        for name, (at, size, shape, dtype) in self.layout.items():
            w = flat[name]
            if tuple(w.shape) != shape or dtype_name(w.dtype) != dtype:
                raise ValueError(f"rollout weights: {name} is {w.dtype}{tuple(w.shape)}, the worker holds "
                                 f"{dtype}{shape}")
            try:
                data = memoryview(w)
            except BufferError:  # a transposed or sliced view: its bytes in order first
                w = mx.contiguous(w)
                mx.eval(w)
                data = memoryview(w)
            view[at:at + size] = np.frombuffer(data, dtype=np.uint8)
        del view, data  # an exported buffer would keep the mapping from closing
        try:
            if self.payload is not None:
                self.conn.send_bytes(self.payload)
                self.payload = None
            self.conn.send((jobs, group_size, params, prefill))
            status, out, seconds = self.conn.recv()
        except (EOFError, OSError):
            answer = self.pending_reply()  # a worker that failed at start-up replied before it closed the pipe
            if answer is not None and answer[0] == "error":
                raise_worker_error(*answer[1])
            self.process.join(1.0)
            code = self.process.exitcode
            raise RuntimeError(f"{WORKER} ended with exit code {code}"
                               + (" (killed: by the system's out-of-memory killer?)" if code == -signal.SIGKILL else "")
                               + ": its rollout is lost; the run stops here") from None
        if status == "error":
            raise_worker_error(*out)
        return out, seconds

    def pending_reply(self):
        try:
            return self.conn.recv() if self.conn.poll(1.0) else None
        except (EOFError, OSError):
            return None

    def stop(self, busy: bool) -> None:
        """End the worker: asked to, when idle; killed when busy (a rollout nobody will train on: Ctrl-C, a
        crash) or when it does not answer. A sample() blocked on it then raises."""
        if self.process.is_alive() and not busy:
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.process.join(STOP_WAIT_S)
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        Path(self.path).unlink(missing_ok=True)  # the worker removes it once mapped; not if it never got there
        if self.cache_before is not None:
            mx.set_cache_limit(self.cache_before)

    def release(self) -> None:
        """Close the pipe and the mapping, once stop() has ended the worker and nothing calls sample()."""
        self.conn.close()
        try:
            self.shared.close()
        except BufferError:  # a failed sample()'s traceback still holds a view: the mapping goes with it
            pass
