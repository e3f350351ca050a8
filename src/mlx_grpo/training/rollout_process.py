"""rollout_worker = "process": async_rollouts' rollouts decode in a process of their own.

In one process the rollout's decode (host-bound) and the training pass slow each other about as much as
they overlap; in two processes the same GPU did 1.44x the work in the same time (BENCHMARKS.md, ninth
sitting). RolloutProcess owns that second process: it is started once with the model (its structure and
weights, pickled) and the tokenizer; before each job the trainable weights to sample from are copied into a
file both processes map (in /dev/shm where there is one: pickling them through the pipe cost ~0.5 s an
update for SmolLM2-135M), and the job carries the batch steps' prompts and row keys; the Rollout records
come back. Nothing else crosses: the draw,
the rewards and the checkpoints stay in the training process (prefetch.py), so the two modes share one
schedule and one resume. The worker ignores Ctrl-C (the training process ends it) and exits when its
pipe closes, so it never outlives the run.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import pickle
import signal
import tempfile
import time
import traceback
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from mlx_grpo.errors import UserError
from mlx_grpo.rollout.engine import RolloutEngine
from mlx_grpo.rollout.records import Rollout, SamplingParams

# The share of the device's memory each of the two processes may keep as freed buffers (MLX's cache): with
# no limit the first process to free memory keeps it, and the other ran out of device memory on an H100.
CACHE_SHARE = 0.1
STOP_WAIT_S = 10.0  # how long a worker told to stop may take before it is killed


def limit_cache() -> None:
    """Cap this process's MLX buffer cache at CACHE_SHARE of the device's memory (where MLX reports it)."""
    size = mx.device_info().get("memory_size", 0)
    if size:
        mx.set_cache_limit(int(size * CACHE_SHARE))


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rpartition(".")[2]  # mlx.core.bfloat16 -> bfloat16 (a Dtype does not pickle)


def weight_layout(weights: dict) -> dict[str, tuple[int, int, tuple, str]]:
    """name -> (byte offset, bytes, shape, dtype name) of each tensor in the shared weights file."""
    layout, at = {}, 0
    for name, w in weights.items():
        layout[name] = (at, w.nbytes, tuple(w.shape), dtype_name(w.dtype))
        at += -(-w.nbytes // 64) * 64  # 64-byte aligned
    return layout


def read_weights(buffer: memoryview, layout: dict) -> dict:
    """The tensors of `layout` copied out of the shared file (so the next job may overwrite it)."""
    out = {}
    for name, (at, size, shape, dtype) in layout.items():
        raw = mx.array(np.frombuffer(buffer, dtype=np.uint8, count=size, offset=at))
        out[name] = raw.view(getattr(mx, dtype)).reshape(shape)
    return out


def serve(conn) -> None:
    """The worker process: receive the model, then sample each job from the weights it carries, until the
    pipe closes or a None job comes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the trainer decides
    limit_cache()
    try:
        start = pickle.loads(conn.recv_bytes())
    except EOFError:
        return
    if start is None:  # stopped before its first job
        return
    model, tokenizer, mode, graph, path, layout = start
    with open(path, "r+b") as f:
        shared = mmap.mmap(f.fileno(), 0)
    os.unlink(path)  # mapped by both processes now: the file goes with them, whatever ends them
    model.eval()
    model.freeze()
    engine = RolloutEngine(tokenizer, mode=mode, graph=graph)
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the training process is gone
            return
        if job is None:
            return
        jobs, group_size, params, prefill = job
        try:
            t0 = time.perf_counter()
            model.update(tree_unflatten(list(read_weights(memoryview(shared), layout).items())))
            engine.refresh(model)
            out = engine.generate_many(jobs, group_size, params, prefill)
            mx.eval([[r.completion_ids, r.mask, r.sampler_logprobs] + ([] if r.entropies is None else [r.entropies])
                     for r in out])
            reply = ("ok", out, time.perf_counter() - t0)
        except Exception:  # reported in the training process, which decides what the run does
            reply = ("error", traceback.format_exc(), 0.0)
        jobs = out = None  # the next job's cache takes their memory
        conn.send(reply)


class RolloutProcess:
    """The training process's side: start() the worker, sample() (blocking; prefetch.py's thread calls it),
    close(). model, tokenizer: the trainer's (pickled once, at start); mode, graph: rollout_engine and
    decode_graph."""

    def __init__(self, model, tokenizer, mode: str, graph: bool):
        self.layout = weight_layout(dict(tree_flatten(model.trainable_parameters())))
        size = max(1, sum(-(-n // 64) * 64 for _, n, _, _ in self.layout.values()))
        shm = Path("/dev/shm")  # memory, not disk, where the system has it
        fd, path = tempfile.mkstemp(prefix="mlx-grpo-weights-", dir=shm if shm.is_dir() else None)
        try:
            os.ftruncate(fd, size)
            self.shared = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        try:
            payload = pickle.dumps((model, tokenizer, mode, graph, path, self.layout), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            os.unlink(path)
            raise UserError(f"rollout_worker = process sends the model to a second process and cannot pickle it "
                            f"({type(exc).__name__}: {exc}): set rollout_worker = thread") from None
        self.path = path
        # spawn, not fork: a forked child would inherit MLX's device state and threads mid-flight
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(child,), name="mlx-grpo-rollouts", daemon=True)
        self.process.start()
        child.close()
        self.payload = payload  # sent with the first job, from prefetch.py's thread: the worker imports MLX first
        limit_cache()  # this process's share: the worker takes the other

    def sample(self, weights: dict, jobs: list[tuple[list[list[int]], mx.array]], group_size: int,
               params: SamplingParams, prefill: str) -> tuple[list[Rollout], float]:
        """The rollouts of `jobs` (generate_many's) sampled from `weights` (a parameter tree with every
        trainable tensor; only those travel, the rest never change), and the seconds the worker took. The
        worker is idle here (one job at a time), so the shared file is free to write."""
        flat = dict(tree_flatten(weights))
        view = np.frombuffer(self.shared, dtype=np.uint8)
        for name, (at, size, shape, dtype) in self.layout.items():
            w = flat[name]
            if tuple(w.shape) != shape or dtype_name(w.dtype) != dtype:
                raise ValueError(f"rollout weights: {name} is {w.dtype}{tuple(w.shape)}, the worker holds "
                                 f"{dtype}{shape}")
            view[at:at + size] = np.frombuffer(memoryview(w), dtype=np.uint8)
        del view  # an exported buffer would keep the mapping from closing
        try:
            if self.payload is not None:
                self.conn.send_bytes(self.payload)
                self.payload = None
            self.conn.send((jobs, group_size, params, prefill))
            status, out, seconds = self.conn.recv()
        except (EOFError, OSError):
            self.process.join(1.0)
            raise RuntimeError(f"the rollout process (rollout_worker = process) ended with exit code "
                               f"{self.process.exitcode}: its last rollout is lost; the run stops here") from None
        if status == "error":
            raise RuntimeError(f"the rollout process (rollout_worker = process) failed:\n{out}")
        return out, seconds

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
        if self.payload is not None:  # never sent: the worker did not map (and remove) the file
            Path(self.path).unlink(missing_ok=True)
