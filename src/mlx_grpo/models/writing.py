"""Writing MLX model directories: built in a temporary sibling, made durable, published by one rename.

Shared by checkpoints, the GGUF, nanochat and reward-model converters and `fuse`, so an interrupted
write (an exception, a kill or a power cut) never leaves a half model where the output points, and
replacing a directory never removes the old one before the new one is on disk.
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

from mlx_grpo.base.errors import UserError

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


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_durable(directory: Path) -> None:
    """fsync every file below directory, then each directory bottom-up: its contents survive a power cut."""
    for root, _, files in os.walk(directory, topdown=False):
        for name in files:
            _fsync(Path(root) / name)
        _fsync(Path(root))


def _umask_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o777 & ~mask


@contextmanager
def staged_output(output_dir: Path, replace: bool = False, prefix: str = ".tmp-") -> Iterator[Path]:
    """Yield an empty temporary directory next to output_dir (named prefix...); on success make it durable
    and rename it to output_dir; on any failure delete it. An existing output_dir is an error, or with
    replace it is moved aside (.old-...) and removed only once its successor is in place and durable."""
    if output_dir.exists() and not replace:
        raise exists_error(output_dir)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=output_dir.parent, prefix=prefix))
    try:
        tmp.chmod(_umask_mode())  # mkdtemp makes it owner-only; the result is an ordinary directory
        yield tmp
        make_durable(tmp)
        old = None
        if output_dir.exists():
            if not replace:  # rename would silently replace an empty directory
                raise exists_error(output_dir)
            old = output_dir.parent / f".old-{output_dir.name}-{tmp.name.rsplit('-', 1)[-1]}"
            os.rename(output_dir, old)
        try:
            os.rename(tmp, output_dir)
        except OSError as e:
            if old is not None:
                os.rename(old, output_dir)
            if output_dir.exists():
                raise exists_error(output_dir) from e
            raise
        _fsync(output_dir.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def recover_staged(parent: Path, prefix: str) -> list[str]:
    """After a hard kill: delete unfinished temporaries (prefix...) in parent and put back any directory
    that was moved aside (.old-NAME-...) while its replacement was being published; -> what was done."""
    done = []
    for old in sorted(parent.glob(".old-*")):
        name = old.name[len(".old-"):].rsplit("-", 1)[0]
        if not (parent / name).exists():
            os.rename(old, parent / name)
            done.append(f"restored {name} from {old.name}")
        else:
            shutil.rmtree(old, ignore_errors=True)
            done.append(f"removed {old.name}")
    for tmp in sorted(parent.glob(f"{prefix}*")):
        shutil.rmtree(tmp, ignore_errors=True)
        done.append(f"removed the unfinished {tmp.name}")
    return done


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
