"""Helpers the bench scripts share: timing, peak memory, the device and library versions of a record."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

GB = 1024 ** 3


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median wall time of `repeats` calls after one warm-up call (compilation, kernel JIT)."""
    result = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def peak_during(fn) -> tuple[float, float, object]:
    """-> (peak bytes above what was allocated before, seconds, result)."""
    mx.eval(mx.zeros(1))
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    t0 = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - t0
    return mx.get_peak_memory() - base, seconds, result


def nbytes(tree) -> int:
    return sum(a.nbytes for _, a in tree_flatten(tree))


def positive(text: str) -> int:
    """argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be at least 1")
    return value


def smollm2_shaped(layers: int, dtype):
    """A random-weight mlx-lm llama of SmolLM2-135M's shape (the embedded default, 30 layers): 9 query / 3 KV heads
    of 64, 576 wide, 49,152 tokens."""
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=576, num_hidden_layers=layers, intermediate_size=1536,
                           num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, vocab_size=49152,
                           rope_theta=100000.0, tie_word_embeddings=True)
    model = llama.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def device_name() -> str:
    if mx.default_device() == mx.gpu:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError):
            pass
        return f"{platform.machine()} GPU (Metal)" if sys.platform == "darwin" else "GPU"
    return f"CPU ({platform.processor() or platform.machine()})"


def versions() -> dict:
    import mlx_lm

    return {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "python": platform.python_version()}


def mlx_settings() -> dict:
    """The MLX_* variables of the environment (MLX's settings such as its CUDA graph limits and cuDNN attention;
    this project's MLX_GRPO_* and the distributed launch's too), which a record's command line does not show."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("MLX_")}


def write_record(out, name: str, record: dict) -> Path:
    """record as JSON to `out`: a .json file, else a folder (made) where it is <name>-<date>-<time>.json. -> its path."""
    import datetime as dt
    import json

    path = Path(out)
    if path.suffix != ".json":
        path = path / f"{name}-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=float) + "\n")
    return path
