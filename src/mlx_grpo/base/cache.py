"""mlx-grpo's cache directory ($MLX_GRPO_CACHE, else ~/.cache/mlx-grpo): converted models, and the GPU kernels
MLX's CUDA build compiles.

MLX's CUDA backend compiles its kernels with NVRTC on first use (its own, mx.compile's fused ones and the
project's mx.fast.cuda_kernel ones) and keeps them in $MLX_PTX_CACHE_DIR, by default <tmp>/mlx/<version>/ptx.
On an H100 the first GRPO step of the standard workload took 169 s with that cache empty and 12 s with it
filled (docs/benchmarks-history.md, ninth sitting). /tmp is emptied at every boot on many systems and at every start of a
container, so the CLI keeps the kernels beside the converted models instead, where a later run finds them.
MLX names a cached kernel by its source alone and compiles it for the GPU it runs on, so the folder is per
MLX version and per GPU model (a home directory shared by machines with different GPUs must not hand one
GPU's code to another), and a machine with two GPU models keeps MLX's default: which one a process runs on
is not known before MLX starts. This module imports nothing that loads mlx.core: MLX reads the variable
when it first compiles a kernel, and the CLI sets it before any subcommand imports MLX.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, MutableMapping
from importlib import metadata
from pathlib import Path

CACHE_ENV = "MLX_GRPO_CACHE"
KERNEL_CACHE_ENV = "MLX_PTX_CACHE_DIR"  # MLX's own variable (mlx/backend/cuda/jit_module.cpp)
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # the driver's per-GPU `information` files (Linux)


def cache_root(environ: MutableMapping[str, str] = os.environ) -> Path:
    """Where converted models and compiled kernels live: $MLX_GRPO_CACHE, else ~/.cache/mlx-grpo."""
    return Path(environ.get(CACHE_ENV) or Path.home() / ".cache" / "mlx-grpo")


def _installed() -> Iterable[tuple[str, str]]:
    """(name, version) of the installed distributions, in sys.path order (the first of a name is imported)."""
    return ((d.metadata["Name"] or "", d.version) for d in metadata.distributions())


def gpu_models(gpus: Path = NVIDIA_GPUS) -> list[str]:
    """The NVIDIA driver's model names of this machine's GPUs (["NVIDIA H100 80GB HBM3"]), sorted, distinct;
    [] where the driver does not list them."""
    models = set()
    try:
        for info in gpus.glob("*/information"):
            found = re.search(r"^Model:[ \t]*(\S.*?)[ \t]*$", info.read_text(errors="replace"), re.MULTILINE)
            if found:
                models.add(found.group(1))
    except OSError:
        return []
    return sorted(models)


def keep_compiled_kernels(environ: MutableMapping[str, str] = os.environ,
                          installed: Callable[[], Iterable[tuple[str, str]]] | None = None,
                          gpus: Callable[[], list[str]] = gpu_models) -> Path | None:
    """Point MLX's kernel cache at <cache_root>/kernels/mlx-<version>/<GPU model> when MLX's CUDA build is
    installed and $MLX_PTX_CACHE_DIR is not set (set empty, it turns MLX's cache off: left so). -> the
    directory, or None where MLX's default was left alone: no CUDA build, not exactly one GPU model, no home
    directory, or a directory that cannot be made (MLX would then cache nothing at all, where its default
    in /tmp still caches for the machine's uptime)."""
    models = gpus()  # first: off NVIDIA machines no package metadata is read at every CLI start
    if KERNEL_CACHE_ENV in environ or len(models) != 1:
        return None
    versions: dict[str, str] = {}
    for name, version in (installed or _installed)():
        versions.setdefault(name.lower().replace("_", "-"), version)
    if "mlx" not in versions or not any(name.startswith("mlx-cuda") for name in versions):
        return None
    gpu = re.sub(r"[^A-Za-z0-9.]+", "-", models[0]).strip("-")  # NVIDIA-H100-80GB-HBM3
    try:
        path = (cache_root(environ) / "kernels" / f"mlx-{versions['mlx']}" / gpu).absolute()
        path.mkdir(parents=True, exist_ok=True)
    except (OSError, RuntimeError):  # RuntimeError: no home directory to expand ~ in
        return None
    if not os.access(path, os.W_OK):
        return None
    environ[KERNEL_CACHE_ENV] = str(path)
    return path
