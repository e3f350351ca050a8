"""Ctrl-C: end a command within a moment, whatever its main thread is doing.

Python runs a SIGINT handler only in the main thread, between bytecodes: a long native call (MLX evaluating a
training pass, which can take minutes on a CPU) would hold Ctrl-C until it returns. Here the signal's C-level
handler writes to a pipe (signal.set_wakeup_fd) that a watcher thread reads; the watcher prints one line and
ends the process at once (os._exit(130)). It can run while MLX computes because MLX releases the GIL then.

Ending without unwinding is safe for what a run leaves on disk: model directories and checkpoints are built in
a temporary and published by one rename (models/writing.staged_output), so an exit mid-write leaves the
earlier checkpoints intact and a temporary that the next start removes; the run directory's lock is an flock,
which the OS releases with the process; the JSONL logs are written a line at a time.

`chat` takes Ctrl-C back inside `interrupts_raise`: there it stops the answer being written, not the command.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

EXIT_CODE = 130  # 128 + SIGINT, what shells report for a command stopped by Ctrl-C
_STOP = b"\0"  # written by the main thread to end the watcher; no signal has the number 0


def _ignore(signum, frame) -> None:
    """The Python-level SIGINT handler: nothing (the watcher acts). Its presence makes the C-level handler
    write to the wakeup pipe; doing nothing lets the main thread carry on until the watcher ends it."""


def _watch(read_fd: int, message: str, detail: Callable[[], str | None] | None) -> None:
    while True:
        data = os.read(read_fd, 64)
        if signal.SIGINT in data:
            break
        if not data or _STOP[0] in data:
            return
    # What was printed so far comes before the line; in a helper thread, given a moment only: the main
    # thread may hold a stream's lock, blocked writing to a pipe nobody reads.
    flusher = threading.Thread(target=_flush, daemon=True)
    flusher.start()
    flusher.join(0.2)
    try:
        extra = _ask(detail) if detail is not None else None
        line = f"{message}; {extra}" if extra else message
        newline = "\n" if os.isatty(2) else ""  # below a progress bar's line
        os.write(2, f"{newline}{line}\n".encode())
    finally:  # a closed or broken stderr must not keep the process alive
        os._exit(EXIT_CODE)


def _ask(detail: Callable[[], str | None]) -> str | None:
    """detail()'s text, read now (what a run has saved by the time of the signal), given a second in a helper
    thread: a run directory on a lost mount must not hold the exit; a failure leaves the line without it."""
    answer: list[str | None] = []

    def ask() -> None:
        try:
            answer.append(detail())
        except Exception:  # noqa: BLE001 -- the line still goes out, without it
            pass

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    asker.join(1.0)
    return answer[0] if answer else None


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed, broken or absent: the line still goes out
            pass


@contextmanager
def exit_on_interrupt(message: str, detail: Callable[[], str | None] | None = None) -> Iterator[None]:
    """While inside, SIGINT prints `message` to stderr (then "; " and detail()'s text, asked for when the signal
    comes, if it gives one) and ends the process with exit code 130 within a moment, in any phase. Does nothing
    outside the main thread or where SIGINT is ignored (a background job)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None):
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # set_wakeup_fd requires it: the C handler must never block
    watcher = threading.Thread(target=_watch, args=(read_fd, message, detail), name="mlx-grpo-ctrl-c", daemon=True)
    watcher.start()
    previous_handler = signal.signal(signal.SIGINT, _ignore)
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGINT, previous_handler)
        os.write(write_fd, _STOP)
        watcher.join()
        os.close(read_fd)
        os.close(write_fd)


@contextmanager
def interrupts_raise() -> Iterator[None]:
    """Inside exit_on_interrupt's region: Ctrl-C raises KeyboardInterrupt in the main thread instead of ending
    the process, for a caller that stops only what it is doing (chat: the answer being written). Python raises it
    between bytecodes, so a long native call finishes first (a decode step is short). Does nothing outside the
    main thread or where SIGINT is ignored (a background job)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None):
        yield
        return
    previous_fd = signal.set_wakeup_fd(-1)  # the watcher hears nothing while inside
    previous_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:  # the pipe first: a Ctrl-C between the two lines still ends the command, never goes unheard
        signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGINT, previous_handler)
