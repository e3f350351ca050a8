"""The rollout process's side of rollout_worker = "process" (process.py has the training process's): serve
receives the model once, then samples each job from the weights in the shared file, and sends back the
Rollout records or the failure. worker_entry.py runs it after its set-up; the layout of the shared file and
the cache cap are defined here for both sides."""

from __future__ import annotations

import mmap
import pickle
import time
import traceback

import mlx.core as mx
import numpy as np
from mlx.utils import tree_unflatten

from mlx_grpo.rollout.engine import RolloutEngine

# The share of the device's memory each of the two processes may keep as freed buffers (MLX's cache): with
# no limit the first process to free memory keeps it, and the other ran out of device memory on an H100.
CACHE_SHARE = 0.1


def limit_cache() -> int | None:
    """Cap this process's MLX buffer cache at CACHE_SHARE of the device's memory (where MLX reports it);
    -> the limit before (None: not set)."""
    size = mx.device_info().get("memory_size", 0)
    return mx.set_cache_limit(int(size * CACHE_SHARE)) if size else None


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rpartition(".")[2]  # mlx.core.bfloat16 -> bfloat16 (a Dtype does not pickle)


def weight_layout(weights: dict) -> dict[str, tuple[int, int, tuple, str]]:
    """name -> (byte offset, bytes, shape, dtype name) of each tensor in the shared weights file."""
    layout, at = {}, 0
    for name, w in weights.items():
        layout[name] = (at, w.nbytes, tuple(w.shape), dtype_name(w.dtype))
        at += -(-w.nbytes // 64) * 64  # each tensor starts on a cache line: whole-line copies in and out
    return layout


def read_weights(buffer: memoryview, layout: dict) -> dict:
    """The tensors of `layout` copied out of the shared file (so the next job may overwrite it)."""
    out = {}
    for name, (at, size, shape, dtype) in layout.items():
        raw = mx.array(np.frombuffer(buffer, dtype=np.uint8, count=size, offset=at))
        out[name] = raw.view(getattr(mx, dtype)).reshape(shape)
    return out


def serve(conn, shared: mmap.mmap) -> None:
    """The worker process (after worker_entry.py's set-up): receive the model, then sample each job from the
    weights in `shared`, until the pipe closes or a None job comes. Failures are sent back, not printed."""
    try:
        start = pickle.loads(conn.recv_bytes())
        if start is None:  # stopped before its first job
            return
        model, tokenizer, mode, graph, rows, layout = start
        limit_cache()  # this process's share: the training process keeps the other
        model.eval()
        model.freeze()
        engine = RolloutEngine(tokenizer, mode=mode, graph=graph, rows=rows)
    except EOFError:
        return
    except Exception as exc:
        reply(conn, failure(exc))
        raise SystemExit(3) from None  # after the reply: a non-zero exit says the worker never started
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the training process is gone
            return
        if job is None:
            return
        try:
            t0 = time.perf_counter()
            model.update(tree_unflatten(list(read_weights(memoryview(shared), layout).items())))
            engine.refresh(model)
            out = engine.generate_many(*job)
            mx.eval([r.arrays for r in out])
            answer = ("ok", out, time.perf_counter() - t0)
        except Exception as exc:  # raised in the training process, which decides what the run does
            answer = failure(exc)
        job = out = None  # the next job's cache takes their memory
        if not reply(conn, answer):
            return


def failure(exc: BaseException) -> tuple:
    return "error", (type(exc).__name__, str(exc), traceback.format_exc()), 0.0


def reply(conn, answer) -> bool:
    try:
        conn.send(answer)
        return True
    except OSError:  # the training process is gone
        return False
