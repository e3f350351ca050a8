"""Mixed precision: a run's compute dtype, casting a model to it, and the rounding check.

The model runs forward, backward and rollouts in the compute dtype (bfloat16 for the embedded default on
a GPU, the stored dtype for other models). With master weights (training/optimization.MasterWeights) the trained
tensors also live in float32: AdamW (its state float32 too) updates the masters, and the compute copy is
refreshed from them after every update, so steps far below bfloat16's spacing accumulate instead of rounding
away; check_rounding says how much of an update would round away without them.
"""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from mlx_grpo.config import DEFAULT_MODEL

# Explicit mantissa bits of the half-precision types: a value w is stored to a spacing of
# 2^(floor(log2 |w|) - bits).
MANTISSA_BITS = {mx.bfloat16: 7, mx.float16: 10}
# Without masters: refuse a run when at least this share of an AdamW step would round away, warn above WARN.
REFUSE_SHARE = 0.5
WARN_SHARE = 0.05


def stored_dtype(model: nn.Module) -> mx.Dtype:
    """The floating dtype holding most of the model's float weights (quantized packs are not floats)."""
    counts = Counter()
    for _, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            counts[p.dtype] += p.size
    return counts.most_common(1)[0][0] if counts else mx.float32


def compute_dtype(model_name: str, model_dtype: str, model: nn.Module) -> mx.Dtype:
    """The dtype a run computes in. model_dtype names it, or 'auto': bfloat16 for the embedded default
    on a GPU (its stored float32 only comes from dequantizing the GGUF file) and float32 on a CPU, whose
    MLX matmuls are ~30x slower in bfloat16 (measured: 6.9 vs 204 GFLOP/s with OpenBLAS); for any other
    model the dtype it is stored in."""
    if model_dtype != "auto":
        return getattr(mx, model_dtype)
    if model_name == DEFAULT_MODEL:
        return mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    return stored_dtype(model)


def cast_floats(model: nn.Module, dtype: mx.Dtype) -> None:
    """Cast every float parameter of the model (quantization scales included) to dtype, in place."""
    model.update(tree_map(lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p,
                          model.parameters()))


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def rounding_share(params: dict[str, mx.array], learning_rate: float, dtype: mx.Dtype) -> float:
    """The share of the weights in `params` (flat) whose AdamW step would be lost when stored in dtype.

    AdamW's first steps move each weight by about learning_rate (m / sqrt(v) is +-1 at the start); a
    step below half the dtype's spacing at the weight's magnitude rounds back to the same value."""
    bits = MANTISSA_BITS.get(dtype)
    if bits is None or not params:
        return 0.0
    lost = total = 0
    for p in params.values():
        w = mx.abs(p.astype(mx.float32))
        spacing = mx.where(w > 0, mx.power(2.0, mx.floor(mx.log2(mx.maximum(w, 1e-38))) - bits), 0.0)
        lost += int((learning_rate < 0.5 * spacing).sum().item())
        total += p.size
    return lost / total if total else 0.0


def check_rounding(params: dict[str, mx.array], learning_rate: float, dtype: mx.Dtype, hint: str) -> str | None:
    """Without master weights: None when the step survives, a warning text when a small share of the
    update rounds away; raises UserError when most of it would."""
    from mlx_grpo.base.errors import UserError

    share = rounding_share(params, learning_rate, dtype)
    if share < WARN_SHARE:
        return None
    text = (f"{dtype_name(dtype)} weights without master weights: AdamW steps at learning_rate "
            f"{learning_rate:g} are below half the {dtype_name(dtype)} spacing for {share:.0%} of the trained "
            f"weights, so that share of every update rounds away")
    if share >= REFUSE_SHARE:
        raise UserError(f"{text}; {hint}")
    return f"{text}; {hint}"
