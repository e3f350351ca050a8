"""mlx-grpo's cache directory ($MLX_GRPO_CACHE, else ~/.cache/mlx-grpo): converted models, and the GPU kernels
MLX's CUDA build compiles.

MLX's CUDA backend compiles its kernels with NVRTC on first use (its own, mx.compile's fused ones and the
project's mx.fast.cuda_kernel ones) and keeps them in $MLX_PTX_CACHE_DIR, by default <tmp>/mlx/<version>/ptx.
On an H100 the first GRPO step of the standard workload took 169 s with that cache empty and 12 s with it
filled (BENCHMARKS.md, ninth sitting). /tmp is emptied at every boot on many systems and at every start of a
container, so the CLI keeps the kernels beside the converted models instead, where a later run finds them.
This module imports nothing that loads mlx.core: MLX reads the variable when it first compiles a kernel, and
the CLI sets it before any subcommand imports MLX.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, MutableMapping
from importlib import metadata
from pathlib import Path

CACHE_ENV = "MLX_GRPO_CACHE"
KERNEL_CACHE_ENV = "MLX_PTX_CACHE_DIR"  # MLX's own variable (mlx/backend/cuda/jit_module.cpp)


def cache_root(environ: MutableMapping[str, str] = os.environ) -> Path:
    """Where converted models and compiled kernels live: $MLX_GRPO_CACHE, else ~/.cache/mlx-grpo."""
    return Path(environ.get(CACHE_ENV) or Path.home() / ".cache" / "mlx-grpo")


def _installed() -> Iterable[tuple[str, str]]:
    """(name, version) of the installed distributions."""
    return ((d.metadata["Name"] or "", d.version) for d in metadata.distributions())


def keep_compiled_kernels(environ: MutableMapping[str, str] = os.environ,
                          installed: Callable[[], Iterable[tuple[str, str]]] | None = None) -> Path | None:
    """Point MLX's kernel cache at <cache_root>/kernels/mlx-<version> when MLX's CUDA build is installed and
    $MLX_PTX_CACHE_DIR is not set; -> the directory, or None where it was left alone (no CUDA build, the
    variable set by the user, or a directory that cannot be made: MLX would then cache nothing at all, where
    its default in /tmp still caches for the machine's uptime)."""
    if environ.get(KERNEL_CACHE_ENV):
        return None
    versions = {name.lower().replace("_", "-"): version for name, version in (installed or _installed)()}
    if "mlx" not in versions or not any(name.startswith("mlx-cuda") for name in versions):
        return None
    path = cache_root(environ) / "kernels" / f"mlx-{versions['mlx']}"  # a new MLX compiles afresh, as by default
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    if not os.access(path, os.W_OK):
        return None
    environ[KERNEL_CACHE_ENV] = str(path)
    return path
