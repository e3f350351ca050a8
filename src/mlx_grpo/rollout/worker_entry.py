"""Starting the rollout process (process.py; worker.py runs in it) and what it does before anything
else: this module imports no MLX, so the worker can ignore Ctrl-C, map (and remove) the weights file,
watch the training process and load the BLAS the training process runs on (base/blas.py) before MLX loads, so
both compute the same."""

from __future__ import annotations

import mmap
import multiprocessing
import os
import signal
import threading
from multiprocessing.connection import wait

from mlx_grpo.base.blas import blas_threads, load_first, loaded_blas, set_threads


def start_worker(path: str):
    """Spawn the worker for the weights file at `path` -> (the training process's end of the pipe, the
    process). Ctrl-C is held back until the worker has set it aside (so an early one prints no traceback
    there); spawn, not fork: a forked child would inherit MLX's device state and threads mid-flight."""
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=main, args=(child, path, loaded_blas()), name="mlx-grpo-rollouts", daemon=True)
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    child.close()
    return conn, process


def main(conn, path: str, blas: list[str]) -> None:
    """The worker's first steps, then worker.serve. blas: the BLAS libraries the training process has mapped
    (blas.loaded_blas)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the trainer decides
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    with open(path, "r+b") as f:
        shared = mmap.mmap(f.fileno(), 0)
    os.unlink(path)  # mapped by both processes now: the file goes with them
    threading.Thread(target=exit_with, args=(multiprocessing.parent_process().sentinel,), daemon=True).start()
    library = load_first(blas, explicit=False)  # before MLX loads, as the CLI does
    if library:
        set_threads(library, blas_threads(os.environ, len(os.sched_getaffinity(0))))
    from mlx_grpo.rollout.worker import serve

    serve(conn, shared)


def exit_with(sentinel) -> None:
    """End this process once the training process is gone, however it ended (Ctrl-C leaves through os._exit,
    which runs no clean-up): an orphan would hold its GPU memory."""
    wait([sentinel])
    os._exit(0)
