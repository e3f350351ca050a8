"""The run's console lines: printed through tqdm, so an active progress bar is redrawn below them instead of being
broken. In the lowest layer because every layer that talks to the user prints through it (data parallelism's
rank-0 printing, the logs, the commands)."""

from __future__ import annotations

import sys

from tqdm import tqdm


def console(text: str) -> None:
    """Print a run-time line through tqdm, so an active progress bar is redrawn below it instead of
    being broken; flushed, so a pipe (`| tee`) shows it at once."""
    tqdm.write(text)
    sys.stdout.flush()
