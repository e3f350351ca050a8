"""Parameter-efficient training: LoRA, DoRA and QLoRA on top of mlx-lm's tuner layers.

Owns quantizing the frozen base for QLoRA, turning a model's projections into LoRA/DoRA layers,
switching the adapters off (the frozen base then serves as the KL reference with no second copy of
its weights), reading back the adapter checkpoints the trainer writes, and `mlx-grpo fuse`.
The LoRA math is mlx-lm's (LoRALinear, DoRALinear and their fuse()), and adapter_config.json is in
mlx-lm's format, so `mlx_lm.load(base, adapter_path=checkpoint)` reads our checkpoints too.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.tuner.dora import DoRAEmbedding, DoRALinear
from mlx_lm.tuner.lora import LoRAEmbedding, LoRALinear, LoRASwitchLinear
from mlx_lm.tuner.utils import linear_to_lora_layers

from mlx_grpo.errors import UserError
from mlx_grpo.models.precision import cast_floats
from mlx_grpo.models.writing import QUANT_GROUP_SIZES, copy_model_files, exists_error, staged_output

ADAPTER_WEIGHTS = "adapters.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
TRAIN_TYPES = ("lora", "dora")
QLORA_BITS = (4, 8)
# The layer types an adapted model contains (each wraps its base layer as .linear or .embedding).
ADAPTER_LAYERS = (LoRALinear, DoRALinear, LoRASwitchLinear, LoRAEmbedding, DoRAEmbedding)
# Files of a checkpoint that are training state, not part of a plain model directory.
_TRAINING_FILES = {"config.json", ADAPTER_CONFIG, ADAPTER_WEIGHTS, "optimizer.safetensors",
                   "trainer_state.json", "config.resolved.json"}


def _is_quantized(model: nn.Module) -> bool:
    # Every quantized MLX layer (linear, embedding, switch) carries `scales`.
    return any("scales" in m for _, m in model.named_modules())


def _adapter_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, ADAPTER_LAYERS)]


def _has_full_weights(path: Path) -> bool:
    return any(path.glob("model*.safetensors"))


def quantize_base(model: nn.Module, bits: int, group_size: int = 64) -> None:
    """QLoRA: quantize the (still adapter-free) base in place. Layers whose input width is not a
    multiple of group_size stay in float."""
    if bits not in QLORA_BITS:
        raise UserError(f"load_in_bits must be 4 or 8 (or 0 for a float base), got {bits}")
    if group_size not in QUANT_GROUP_SIZES:
        raise UserError(f"quantization group size must be one of {QUANT_GROUP_SIZES}, got {group_size}")
    if _is_quantized(model):
        raise UserError("model is already quantized; drop load_in_bits")
    if _adapter_modules(model):  # DoRA's magnitudes were measured on the float weights
        raise UserError("quantize the base before adding adapters, not after")
    compatible = [n for n, m in model.named_modules()
                  if hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0]
    if not compatible:  # silently training plain LoRA would waste the memory the user asked to save
        raise UserError(f"load_in_bits: no layer's input width is a multiple of the group size {group_size}")
    nn.quantize(model, group_size=group_size, bits=bits,
                class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0)
    mx.eval(model.parameters())  # materialize now so the float originals can be freed


def lora_block_keys(model: nn.Module) -> list[str]:
    """Names, relative to a transformer block, of its Linear/QuantizedLinear projections (sorted).
    The union over all blocks (equal to block 0's for the usual homogeneous models); a projection
    already wrapped in an adapter counts under its own name."""
    keys: set[str] = set()
    for block in model.layers:
        wrapped = [name for name, m in block.named_modules() if isinstance(m, ADAPTER_LAYERS)]
        keys.update(wrapped)
        for name, m in block.named_modules():
            if isinstance(m, (nn.Linear, nn.QuantizedLinear)) and not any(
                    name.startswith(w + ".") for w in wrapped):
                keys.add(name)
    return sorted(keys)


def apply_adapters(model: nn.Module, train_type: str, rank: int, alpha: float, dropout: float,
                   num_layers: int, keys: list[str]) -> dict:
    """Freeze the model and wrap `keys` (empty: every projection) of its last `num_layers` blocks
    (0: all) in LoRA or DoRA layers. Returns the adapter config in mlx-lm's adapter_config.json format."""
    if train_type not in TRAIN_TYPES:
        raise UserError(f"unknown adapter type {train_type!r}: choose one of {', '.join(TRAIN_TYPES)}")
    if rank < 1:
        raise UserError(f"LoRA rank must be at least 1, got {rank}")
    if _adapter_modules(model):
        raise UserError("the model already has adapters (was it loaded from a LoRA checkpoint?)")
    total = len(model.layers)
    if not 0 <= num_layers <= total:
        raise UserError(f"LoRA num_layers={num_layers}, but the model has {total} layers (0 = all)")
    count = num_layers or total
    valid = lora_block_keys(model)
    for key in keys:
        if key not in valid:
            nearest = difflib.get_close_matches(key, valid, n=1, cutoff=0.0)
            hint = f" (did you mean {nearest[0]!r}?)" if nearest else ""
            raise UserError(f"unknown LoRA key {key!r}{hint}; valid keys: {', '.join(valid)}")
    chosen = sorted(set(keys)) if keys else valid
    lora_parameters = {"rank": rank, "scale": alpha / rank, "dropout": dropout, "keys": chosen}
    training = model.training
    model.freeze()
    linear_to_lora_layers(model, count, dict(lora_parameters), use_dora=train_type == "dora")
    # New modules start in training mode (dropout on) whatever the model's mode: make them follow it.
    model.train(training)
    return {"fine_tune_type": train_type, "num_layers": count, "lora_parameters": lora_parameters}


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """The exact base model for the duration: every adapter layer is swapped for the base layer it
    wraps (the same module object, so no weight is copied), and swapped back afterwards. Scaling
    the update to zero would not do: DoRA's magnitude vector still rescales the output."""
    adapters = _adapter_modules(model)
    if not adapters:
        yield model
        return
    model.update_modules(tree_unflatten([(n, m.linear if hasattr(m, "linear") else m.embedding)
                                         for n, m in adapters]))
    try:
        yield model
    finally:
        model.update_modules(tree_unflatten(adapters))


def adapter_parameters(model: nn.Module) -> dict[str, mx.array]:
    """The trainable (adapter) tensors, flattened: the content of adapters.safetensors."""
    return dict(tree_flatten(model.trainable_parameters()))


def is_adapter_checkpoint(path) -> bool:
    path = Path(path)
    return ((path / ADAPTER_CONFIG).is_file() and (path / ADAPTER_WEIGHTS).is_file()
            and not _has_full_weights(path))


def _base_of(path: Path, record: dict) -> str:
    ours = record.get("mlx_grpo") or {}
    base_dir, base_model = ours.get("base_dir"), ours.get("base_model") or record.get("model")
    # base_dir is where the base was found at training time; base_model (a name, hub id or path)
    # re-resolves it elsewhere, e.g. the embedded default model in another cache.
    if base_dir and Path(base_dir).is_dir():
        return str(base_dir)
    if base_model:
        return str(base_model)
    raise UserError(f"{path / ADAPTER_CONFIG} does not record its base model")


def _load_adapter_weights(model: nn.Module, path: Path) -> None:
    """Strict both ways: every saved tensor lands on an adapter of the same shape, and every adapter
    is in the file (a missing one would silently keep its random init)."""
    file = path / ADAPTER_WEIGHTS
    try:
        weights = mx.load(str(file))
    except Exception as exc:
        raise UserError(f"could not read {file}: {exc}") from None
    expected = adapter_parameters(model)
    problems = [f"{k}: not an adapter of this model" for k in weights if k not in expected]
    problems += [f"{k}: shape {tuple(w.shape)}, the model's is {tuple(expected[k].shape)}"
                 for k, w in weights.items() if k in expected and w.shape != expected[k].shape]
    problems += [f"{k}: missing" for k in expected if k not in weights]
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        raise UserError(f"{file} does not match the adapter layers its config describes: "
                        f"{'; '.join(problems[:3])}{more}")
    model.load_weights(list(weights.items()), strict=False)


def load_with_adapters(path, dtype: str = "auto"):
    """(model, tokenizer) of an adapter checkpoint: its base (re-quantized for QLoRA, exactly as at
    training time), the adapter layers of its config, and its adapter weights; model in eval mode."""
    from mlx_grpo.models.loading import load_model  # loading imports this module lazily too

    path = Path(path)
    if not is_adapter_checkpoint(path):
        raise UserError(f"{path} is not an adapter checkpoint (needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}, "
                        "and no model.safetensors)")
    try:
        record = json.loads((path / ADAPTER_CONFIG).read_text())
        fine_tune_type = record.get("fine_tune_type", "lora")
        num_layers, lora_parameters = record["num_layers"], record["lora_parameters"]
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"{path / ADAPTER_CONFIG} is not a valid adapter config: {exc!r}") from None
    if fine_tune_type not in TRAIN_TYPES:
        raise UserError(f"{path / ADAPTER_CONFIG}: unsupported fine_tune_type {fine_tune_type!r}")
    ours = record.get("mlx_grpo") or {}
    base = _base_of(path, record)
    try:
        # Load in the training dtype and quantize as training did; `dtype` is applied at the end, so
        # the quantized base is bit-identical to the one the adapters were trained on.
        model, tokenizer = load_model(base, ours.get("model_dtype") or "auto")
    except UserError as exc:
        raise UserError(f"adapter checkpoint {path}: cannot load its base model {base!r}: {exc}") from None
    if ours.get("load_in_bits"):
        quantize_base(model, int(ours["load_in_bits"]), int(ours.get("group_size", 64)))
    model.freeze()
    try:
        linear_to_lora_layers(model, num_layers, dict(lora_parameters), use_dora=fine_tune_type == "dora")
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise UserError(f"adapter checkpoint {path}: its config does not fit the base {base!r}: {exc!r}") from None
    _load_adapter_weights(model, path)
    if dtype != "auto":
        cast_floats(model, getattr(mx, dtype))
    model.eval()  # the adapter layers were created in training mode (dropout on)
    mx.eval(model.parameters())
    return model, tokenizer


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
    if _has_full_weights(source):
        raise UserError(f"{source} holds full weights; it is already a plain model: use it directly")
    if not is_adapter_checkpoint(source):
        raise UserError(f"{source} is not an adapter checkpoint (no {ADAPTER_CONFIG} or {ADAPTER_WEIGHTS})")
    if out.exists():  # before the (slow) load; staged_output checks again at publish time
        raise exists_error(out)
    model, _ = load_with_adapters(source)
    fused = [(name, _fused(m, dequantize)) for name, m in _adapter_modules(model)]
    model.update_modules(tree_unflatten(fused))
    config = json.loads((source / "config.json").read_text())
    if dequantize:  # layers without adapters (e.g. a QLoRA embedding) too
        model = dequantize_model(model)
        config.pop("quantization", None)
        config.pop("quantization_config", None)
    elif _is_quantized(model) and "quantization" not in config:
        # A QLoRA base was quantized at load time; mlx-lm needs the entry to rebuild quantized layers
        # (it infers per-layer settings from the saved scales, so layers left in float are fine).
        config["quantization"] = _quantization_of(model)
    mx.eval(model.parameters())
    with staged_output(out) as tmp:
        save_model(tmp, model)
        save_config(config, tmp / "config.json")
        copy_model_files(source, tmp, skip=_TRAINING_FILES)
    return out
