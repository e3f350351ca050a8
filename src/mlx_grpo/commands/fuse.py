"""`mlx-grpo fuse`: an adapter checkpoint merged into its base and written as a plain MLX model directory."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from mlx_grpo.base.errors import UserError
from mlx_grpo.models.adapters import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, TRAINING_FILES, adapter_modules, has_full_weights,
                                      is_adapter_checkpoint, is_quantized)
from mlx_grpo.models.model_loading import load_with_adapters
from mlx_grpo.models.precision import cast_floats
from mlx_grpo.models.writing import copy_model_files, exists_error, staged_output


def _fused(module: nn.Module, dequantize: bool) -> nn.Module:
    base = module.linear if hasattr(module, "linear") else module.embedding
    dtype = base.scales.dtype if "scales" in base else base.weight.dtype
    fused = module.fuse(dequantize=dequantize)
    # DoRA's float32 magnitude promotes the fused weight; keep the base's float dtype.
    cast_floats(fused, dtype)
    return fused


def _quantization_of(model: nn.Module) -> dict:
    for _, m in model.named_modules():
        if "scales" in m:
            return {"group_size": m.group_size, "bits": m.bits, "mode": getattr(m, "mode", "affine")}
    raise AssertionError("no quantized layer")


def run_fuse(checkpoint: str, output_dir: str, dequantize: bool = False) -> Path:
    """`mlx-grpo fuse`: merge an adapter checkpoint into its base and write a plain MLX model
    directory (published atomically). A quantized (QLoRA) base stays quantized unless `dequantize`."""
    from mlx_lm.utils import dequantize_model, save_config, save_model

    source, out = Path(checkpoint), Path(output_dir)
    if not source.is_dir():
        raise UserError(f"checkpoint directory not found: {source}")
    if has_full_weights(source):
        raise UserError(f"{source} holds full weights; it is already a plain model: use it directly")
    if not is_adapter_checkpoint(source):
        raise UserError(f"{source} is not an adapter checkpoint (no {ADAPTER_CONFIG} or {ADAPTER_WEIGHTS})")
    if out.exists():  # before the (slow) load; staged_output checks again at publish time
        raise exists_error(out)
    model, _ = load_with_adapters(source)
    fused = [(name, _fused(m, dequantize)) for name, m in adapter_modules(model)]
    model.update_modules(tree_unflatten(fused))
    config = json.loads((source / "config.json").read_text())
    if dequantize:  # layers without adapters (e.g. a QLoRA embedding) too
        model = dequantize_model(model)
        config.pop("quantization", None)
        config.pop("quantization_config", None)
    elif is_quantized(model) and "quantization" not in config:
        # A QLoRA base was quantized at load time; mlx-lm needs the entry to rebuild quantized layers
        # (it infers per-layer settings from the saved scales, so layers left in float are fine).
        config["quantization"] = _quantization_of(model)
    mx.eval(model.parameters())
    with staged_output(out) as tmp:
        save_model(tmp, model)
        save_config(config, tmp / "config.json")
        copy_model_files(source, tmp, skip=TRAINING_FILES)
    return out
