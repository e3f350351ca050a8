"""Parameter-efficient training: LoRA, DoRA and QLoRA on top of mlx-lm's tuner layers.

Owns quantizing the frozen base for QLoRA, turning a model's projections into LoRA/DoRA layers (the
routed experts of MoE models, SwitchLinear, into LoRASwitchLinear, as mlx-lm's own LoRA does),
switching the adapters off (the frozen base then serves as the KL reference with no second copy of
its weights) and the pieces of the adapter checkpoints the trainer writes (loading.py builds a model
from one; fuse.py merges one into its base for `mlx-grpo fuse`).
The LoRA math is mlx-lm's (LoRALinear, DoRALinear, LoRASwitchLinear and their fuse()), and
adapter_config.json is in mlx-lm's format, so `mlx_lm.load(base, adapter_path=checkpoint)` reads our checkpoints too.
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
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear
from mlx_lm.tuner.dora import DoRAEmbedding, DoRALinear
from mlx_lm.tuner.lora import LoRAEmbedding, LoRALinear, LoRASwitchLinear
from mlx_lm.tuner.utils import linear_to_lora_layers

from mlx_grpo.base.errors import UserError
from mlx_grpo.models.writing import QUANT_GROUP_SIZES

ADAPTER_WEIGHTS = "adapters.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
TRAIN_TYPES = ("lora", "dora")
QLORA_BITS = (4, 8)
# The layer types an adapted model contains (each wraps its base layer as .linear or .embedding).
ADAPTER_LAYERS = (LoRALinear, DoRALinear, LoRASwitchLinear, LoRAEmbedding, DoRAEmbedding)
# What a block's adapters can wrap: mlx-lm's linear_to_lora_layers takes these (and embeddings, which no
# block of the families we train holds); experts are a MoE's routed projections, [experts, out, in] each.
EXPERT_LAYERS = (SwitchLinear, QuantizedSwitchLinear)
PROJECTION_LAYERS = (nn.Linear, nn.QuantizedLinear, *EXPERT_LAYERS)
# Files of a checkpoint that are training state, not part of a plain model directory.
TRAINING_FILES = {"config.json", ADAPTER_CONFIG, ADAPTER_WEIGHTS, "optimizer.safetensors",
                   "trainer_state.json", "config.resolved.json"}


def is_quantized(model: nn.Module) -> bool:
    # Every quantized MLX layer (linear, embedding, switch) carries `scales`.
    return any("scales" in m for _, m in model.named_modules())


def adapter_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, ADAPTER_LAYERS)]


def has_full_weights(path: Path) -> bool:
    return any(path.glob("model*.safetensors"))


def quantize_base(model: nn.Module, bits: int, group_size: int = 64) -> None:
    """QLoRA: quantize the (still adapter-free) base in place. Layers whose input width is not a
    multiple of group_size stay in float."""
    if bits not in QLORA_BITS:
        raise UserError(f"load_in_bits must be 4 or 8 (or 0 for a float base), got {bits}")
    if group_size not in QUANT_GROUP_SIZES:
        raise UserError(f"quantization group size must be one of {QUANT_GROUP_SIZES}, got {group_size}")
    if is_quantized(model):
        raise UserError("model is already quantized; drop load_in_bits")
    if adapter_modules(model):  # DoRA's magnitudes were measured on the float weights
        raise UserError("quantize the base before adding adapters, not after")
    compatible = [n for n, m in model.named_modules()
                  if hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0]
    if not compatible:  # silently training plain LoRA would waste the memory the user asked to save
        raise UserError(f"load_in_bits: no layer's input width is a multiple of the group size {group_size}")
    nn.quantize(model, group_size=group_size, bits=bits,
                class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0)
    mx.eval(model.parameters())  # materialize now so the float originals can be freed


def _block_projections(blocks) -> Iterator[tuple[str, nn.Module]]:
    """(name relative to its block, base layer) of every projection in `blocks`; a projection already
    wrapped in an adapter counts under its own name, as the layer it wraps."""
    for block in blocks:
        wrapped = [name for name, m in block.named_modules() if isinstance(m, ADAPTER_LAYERS)]
        for name, m in block.named_modules():
            if isinstance(m, ADAPTER_LAYERS):
                yield name, getattr(m, "linear", m)
            elif isinstance(m, PROJECTION_LAYERS) and not any(name.startswith(w + ".") for w in wrapped):
                yield name, m


def lora_block_keys(model: nn.Module) -> list[str]:
    """Names, relative to a transformer block, of its Linear/QuantizedLinear projections and MoE expert
    (Quantized)SwitchLinear projections (sorted): mlx-lm's own LoRA defaults. The union over all blocks
    (equal to block 0's for the usual homogeneous models)."""
    return sorted({name for name, _ in _block_projections(model.layers)})


def expert_block_keys(model: nn.Module, num_layers: int = 0) -> list[str]:
    """The keys of lora_block_keys that are routed experts, in the last num_layers blocks (0: all)."""
    blocks = model.layers[-num_layers:] if num_layers else model.layers
    return sorted({name for name, m in _block_projections(blocks) if isinstance(m, EXPERT_LAYERS)})


def apply_adapters(model: nn.Module, train_type: str, rank: int, alpha: float, dropout: float,
                   num_layers: int, keys: list[str]) -> dict:
    """Freeze the model and wrap `keys` (empty: every projection, MoE experts included) of its last
    `num_layers` blocks (0: all) in LoRA or DoRA layers (experts: LoRA only; DoRA on them is refused).
    Returns the adapter config in mlx-lm's adapter_config.json format."""
    if train_type not in TRAIN_TYPES:
        raise UserError(f"unknown adapter type {train_type!r}: choose one of {', '.join(TRAIN_TYPES)}")
    if rank < 1:
        raise UserError(f"LoRA rank must be at least 1, got {rank}")
    if adapter_modules(model):
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
    experts = [k for k in expert_block_keys(model, count) if k in chosen]
    if train_type == "dora" and experts:
        # mlx-lm has no DoRA layer for experts. Mixing (DoRA on the rest, LoRA on experts) would be a
        # checkpoint mlx-lm cannot load, and skipping them would leave most of a MoE's weights untouched
        # unasked: the user chooses.
        others = [k for k in valid if k not in expert_block_keys(model)]
        raise UserError(f"DoRA cannot adapt MoE expert projections ({', '.join(experts)}): mlx-lm has DoRA "
                        f"only for linear layers; use train_type = lora, or set lora_keys to projections "
                        f"without them: {', '.join(others) or '(none)'}")
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
    adapters = adapter_modules(model)
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
            and not has_full_weights(path))


def adapter_base(path: Path, record: dict) -> str:
    ours = record.get("mlx_grpo") or {}
    base_dir, base_model = ours.get("base_dir"), ours.get("base_model") or record.get("model")
    # base_dir is where the base was found at training time; base_model (a name, hub id or path)
    # re-resolves it elsewhere, e.g. the embedded default model in another cache.
    if base_dir and Path(base_dir).is_dir():
        return str(base_dir)
    if base_model:
        return str(base_model)
    raise UserError(f"{path / ADAPTER_CONFIG} does not record its base model")


def read_adapter_config(path: Path) -> tuple[dict, str, int, dict]:
    """An adapter checkpoint's config: (the record, fine_tune_type, num_layers, lora_parameters); one line
    when it is unreadable or names a type we do not train."""
    try:
        record = json.loads((path / ADAPTER_CONFIG).read_text())
        kind, num_layers, lora = record.get("fine_tune_type", "lora"), record["num_layers"], record["lora_parameters"]
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"{path / ADAPTER_CONFIG} is not a valid adapter config: {exc!r}") from None
    if kind not in TRAIN_TYPES:
        raise UserError(f"{path / ADAPTER_CONFIG}: unsupported fine_tune_type {kind!r}")
    return record, kind, num_layers, lora


def attach_saved_adapters(model: nn.Module, path: Path, base: str, kind: str, num_layers: int,
                          lora: dict) -> None:
    """A checkpoint's adapter layers on its (frozen) base `model`, then their saved weights."""
    model.freeze()
    try:
        linear_to_lora_layers(model, num_layers, dict(lora), use_dora=kind == "dora")
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise UserError(f"adapter checkpoint {path}: its config does not fit the base {base!r}: {exc!r}") from None
    load_adapter_weights(model, path)


def load_adapter_weights(model: nn.Module, path: Path) -> None:
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


