"""The GPU tier: the CUDA decode-attention kernels and the keyed sampler (mx.fast.cuda_kernel) against MLX's own
ops, on a CUDA device; skipped without one (tests/conftest.py). The checks are the ones grpo_bench's rollout
section runs before it times anything (bench/rollout_bench.py); here a failed check fails a test.
On a GPU machine: `.venv/bin/python -m pytest -q -m gpu`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
BENCH = Path(__file__).resolve().parents[1] / "bench"


def rollout_bench():
    """bench/rollout_bench.py as a module (it imports bench_util from its own folder)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("rollout_bench", BENCH / "rollout_bench.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def test_the_kernels_serve_on_this_device():
    from mlx_grpo.models.decode_attention import kernel_available

    assert kernel_available(), "a CUDA device without the kernels: MLX's default device is not the GPU"


def test_decode_attention_kernels_match_masked_attention():
    """The plain, log-sum-exp and fused (RoPE + the token's own slot) kernels, both fused layouts (split and
    not), every head dim they serve: within bf16 rounding of MLX's masked attention in float32."""
    result = rollout_bench().check_attention_kernel()
    assert result["kernel"] and result["max_abs_error"]
    for case, errors in result["max_abs_error"].items():
        assert all(e < 2e-2 for e in errors.values()), (case, errors)


def test_keyed_sampler_draws_mlx_noise_and_tokens():
    """The keyed bits give mx.random.gumbel's noise bit for bit and the vmapped categorical's tokens."""
    result = rollout_bench().check_sampler_kernel()
    assert result["kernel"] and all(result["noise_equal"].values()), result
    assert min(result["equal_tokens"].values()) == 1, result
