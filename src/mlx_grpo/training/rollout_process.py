"""rollout_worker = "process": async_rollouts' rollouts decode in a process of their own.

In one process the rollout's decode (host-bound) and the training pass slow each other about as much as
they overlap; in two processes the same GPU did 1.44x the work in the same time (BENCHMARKS.md, ninth
sitting). RolloutProcess owns that second process: it is started once with the model (its structure and
weights, pickled) and the tokenizer, and each job then carries the trainable weights to sample from and
the batch steps' prompts and row keys; the Rollout records come back. Nothing else crosses: the draw,
the rewards and the checkpoints stay in the training process (prefetch.py), so the two modes share one
schedule and one resume. The worker ignores Ctrl-C (the training process ends it) and exits when its
pipe closes, so it never outlives the run.
"""

from __future__ import annotations

import multiprocessing
import pickle
import signal
import time
import traceback

import mlx.core as mx
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
    model, tokenizer, mode, graph = start
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
        weights, jobs, group_size, params, prefill = job
        try:
            t0 = time.perf_counter()
            model.update(tree_unflatten(list(weights.items())))
            engine.refresh(model)
            out = engine.generate_many(jobs, group_size, params, prefill)
            mx.eval([[r.completion_ids, r.mask, r.sampler_logprobs] + ([] if r.entropies is None else [r.entropies])
                     for r in out])
            reply = ("ok", out, time.perf_counter() - t0)
        except Exception:  # reported in the training process, which decides what the run does
            reply = ("error", traceback.format_exc(), 0.0)
        weights = jobs = out = None  # the next job's weights and cache take their memory
        conn.send(reply)


class RolloutProcess:
    """The training process's side: start() the worker, sample() (blocking; prefetch.py's thread calls it),
    close(). model, tokenizer: the trainer's (pickled once, at start); mode, graph: rollout_engine and
    decode_graph."""

    def __init__(self, model, tokenizer, mode: str, graph: bool):
        try:
            payload = pickle.dumps((model, tokenizer, mode, graph), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise UserError(f"rollout_worker = process sends the model to a second process and cannot pickle it "
                            f"({type(exc).__name__}: {exc}): set rollout_worker = thread") from None
        self.trainable = {k for k, _ in tree_flatten(model.trainable_parameters())}
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
        """The rollouts of `jobs` (generate_many's) sampled from `weights` (a parameter tree; only its
        trainable tensors travel, the rest never change), and the seconds the worker took."""
        sent = {k: v for k, v in tree_flatten(weights) if k in self.trainable}
        try:
            if self.payload is not None:
                self.conn.send_bytes(self.payload)
                self.payload = None
            self.conn.send((sent, jobs, group_size, params, prefill))
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
