"""Writing converted MLX model directories: built in a temporary sibling, published by one rename.

Shared by the GGUF and nanochat converters, so an interrupted conversion never leaves a half model
where `--output-dir` points, and both check weights against the mlx-lm model class the same way.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from mlx_grpo.errors import UserError

QUANT_BITS = (2, 3, 4, 5, 6, 8)
RECORD_FILE = "mlx_grpo_convert.json"  # the options a directory was converted with
QUANT_GROUP_SIZES = (32, 64, 128)


# Float types a converted model may be written in
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def mlx_dtype(name: str) -> mx.Dtype:
    if name not in DTYPES:
        raise UserError(f"unsupported dtype {name!r}: choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


# Weight files of a source model: a written directory holds its own weights instead.
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".gguf", ".npz", ".bin")


def copy_model_files(source_dir: Path, target: Path, skip: frozenset[str] | set[str] = frozenset()) -> None:
    """Copy the source's tokenizer, template and other non-weight files, except config.json (the
    writer supplies its own) and the names in skip."""
    for item in source_dir.iterdir():
        if item.is_file() and not item.name.endswith(WEIGHT_SUFFIXES) and item.name != "config.json" \
                and item.name not in skip:
            shutil.copy2(item, target / item.name)


def write_record(directory: Path, options: dict) -> None:
    (directory / RECORD_FILE).write_text(json.dumps(options, indent=2) + "\n")


def exists_error(output_dir: Path) -> UserError:
    return UserError(f"output directory already exists: {output_dir} (delete it or pick another)")


def check_quantization(quantize: bool, bits: int, group_size: int) -> None:
    if quantize and (bits not in QUANT_BITS or group_size not in QUANT_GROUP_SIZES):
        raise UserError(f"unsupported quantization: bits {bits} (2-6 or 8), group size {group_size} "
                        "(32, 64, 128)")


@contextmanager
def staged_output(output_dir: Path) -> Iterator[Path]:
    """Yield an empty temporary directory next to output_dir; rename it to output_dir on success,
    delete it on any failure (losing a race to another writer is a UserError)."""
    if output_dir.exists():
        raise exists_error(output_dir)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=output_dir.parent, prefix=".tmp-"))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; the result is an ordinary model directory
        yield tmp
        if output_dir.exists():  # rename would silently replace an empty directory
            raise exists_error(output_dir)
        try:
            os.rename(tmp, output_dir)
        except OSError as e:
            if output_dir.exists():
                raise exists_error(output_dir) from e
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_mlx_model(out: Path, model: nn.Module, weights: dict, config: dict, *, source: str,
                   quantize: bool, bits: int, group_size: int) -> None:
    """Load weights into the mlx-lm model (strict: every tensor present, no extra, right shapes),
    optionally quantize, and save model.safetensors + config.json into out."""
    from mlx_lm.utils import quantize_model, save_config, save_model

    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise UserError(f"{source}: tensors do not match a {config['model_type']} model of this config: "
                        f"{e}") from None
    if quantize:
        model, config = quantize_model(model, config, group_size, bits)
    save_model(out, model)
    save_config(dict(config), out / "config.json")
