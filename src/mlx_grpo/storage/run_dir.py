"""A run directory (train's and sft's): created, locked for the process's lifetime, cleaned after an interrupted
checkpoint write, and the logs of an earlier run that never reached a checkpoint moved aside."""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

from mlx_grpo.base.errors import UserError
from mlx_grpo.models.writing import recover_staged
from mlx_grpo.storage import checkpoint as ckpt

LOGS = ("metrics.jsonl", "completions.jsonl", "eval.jsonl")


def check_writable(run_dir: Path) -> None:
    """Before the model loads (a download or a conversion can take minutes): the run directory, or the nearest
    directory above it that exists, must take a file. Creates nothing (a temporary file without a name); one
    UserError line otherwise, as prepare_run_dir's failures read."""
    probe = run_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(f"cannot use the run directory {run_dir}: {probe} is not a directory")
    try:
        tempfile.TemporaryFile(dir=probe).close()
    except OSError as exc:
        raise UserError(f"cannot use the run directory {run_dir}: {probe} cannot be written "
                        f"({exc.strerror or exc})") from None


def lock_run_dir(run_dir: Path):
    """Hold an exclusive lock on the run directory for this process's lifetime (released by the OS when
    it dies, however it dies): a second run in the same directory is refused instead of interleaving."""
    lock = open(run_dir / ".lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        owner = lock.read().strip() or "?"
        lock.close()
        raise UserError(f"run directory {run_dir} is in use by another mlx-grpo run (pid {owner}); wait for it, "
                        "or choose another run_name") from None
    lock.seek(0)
    lock.truncate()
    lock.write(str(os.getpid()))
    lock.flush()
    return lock


def prepare_run_dir(run_dir: Path, resume: str | None, world) -> object:
    """Rank 0: create and lock the run directory, clean up after a killed checkpoint write, and move the
    logs of an earlier run that never reached a checkpoint aside (a fresh start must not append to them).
    -> the lock to hold."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = lock_run_dir(run_dir)
    # A run killed while writing a checkpoint leaves its temporary (or a checkpoint moved aside).
    for line in recover_staged(run_dir, ckpt.TMP_PREFIX):
        world.print(f"[mlx-grpo] {run_dir}: {line} (left by an interrupted checkpoint write)")
    old_logs = [run_dir / n for n in LOGS if (run_dir / n).is_file()]
    if resume is None and old_logs and not ckpt.list_checkpoints(run_dir):
        n = 1
        while (run_dir / f"previous-{n}").exists():
            n += 1
        (run_dir / f"previous-{n}").mkdir()
        for path in old_logs:
            path.rename(run_dir / f"previous-{n}" / path.name)
        world.print(f"[mlx-grpo] {run_dir} held the logs of an earlier run without a checkpoint: moved to "
                    f"{run_dir / f'previous-{n}'}")
    return lock
