"""Which vision-language models this package handles, told from a model directory's config.json.

Conversion, generation and chat go through mlx-vlm and take any family it implements; GRPO takes the
families whose language model the training forward (vlm/forward.py) drives with explicit multimodal RoPE
positions: Qwen2-VL and Qwen2.5-VL.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path

from mlx_grpo.base.errors import UserError

GRPO_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
# Files a processor is built from: an image processor config, and a tokenizer
IMAGE_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def require_mlx_vlm() -> None:
    if importlib.util.find_spec("mlx_vlm") is None:
        raise UserError("vision-language models need mlx-vlm: pip install 'mlx-grpo[vlm]'")


def is_vision_config(config: dict) -> bool:
    """A vision-language model's config: it describes a vision encoder."""
    return isinstance(config.get("vision_config"), dict) or "vision_tower" in config or "visual" in config


def read_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise UserError(f"{model_dir}: no config.json (not a model directory)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: invalid JSON ({exc.msg})") from None


def is_vision_dir(model_dir: str | Path) -> bool:
    """Whether a local directory holds a vision-language model (False for anything that is not one)."""
    path = Path(model_dir).expanduser() / "config.json"
    if not path.is_file():
        return False
    try:
        return is_vision_config(json.loads(path.read_text()))
    except (json.JSONDecodeError, OSError):
        return False


def family(config: dict, source: str) -> str:
    """The mlx-vlm model type of a VLM config; an unknown one is a UserError."""
    require_mlx_vlm()
    from mlx_vlm.utils import get_model_type

    kind = get_model_type(dict(config)) or ""
    if not kind or importlib.util.find_spec(f"mlx_vlm.models.{kind}") is None:
        raise UserError(f"{source}: model type {kind or '(none)'!r} is not a vision-language family mlx-vlm "
                        "implements")
    return kind


def check_processor_files(model_dir: Path, source: str) -> None:
    """A VLM directory must carry what its processor is built from."""
    names = {p.name for p in Path(model_dir).iterdir()}
    if not names & set(IMAGE_PROCESSOR_FILES):
        raise UserError(f"{source}: no image processor config ({' or '.join(IMAGE_PROCESSOR_FILES)}); copy the "
                        "processor files from the original model")
    if not names & set(TOKENIZER_FILES):
        raise UserError(f"{source}: no tokenizer ({', '.join(TOKENIZER_FILES)}); copy the tokenizer files from "
                        "the original model")


def check_grpo_family(kind: str, source: str) -> None:
    if kind not in GRPO_FAMILIES:
        raise UserError(f"{source}: GRPO on images supports {', '.join(GRPO_FAMILIES)}, not {kind!r} "
                        "(generate and chat take any mlx-vlm family)")


def eos_ids(model_dir: str, tokenizer) -> set[int]:
    """The ids that end an answer: config.json's eos_token_id (one or a list), else the tokenizer's."""
    eos = read_config(Path(model_dir)).get("eos_token_id")
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids or {tokenizer.eos_token_id}


def image_eval(model_name: str, image_column: str) -> bool:
    """Whether `eval` answers image prompts (commands/vision_eval.py): a vision-language model with image_column set.
    Either without the other is a UserError."""
    vision = is_vision_dir(model_name)
    if image_column and not vision:
        raise UserError(f"image_column = {image_column!r} needs a vision-language model; {model_name!r} is not one "
                        "(a converted VLM directory or a checkpoint of a GRPO run on images)")
    if vision and not image_column:
        raise UserError(f"{model_name!r} is a vision-language model: set image_column (the data's image column, "
                        "e.g. --set image_column=image for the shapes task)")
    return vision
