"""`mlx-grpo convert --hf-path` for vision-language models: mlx-vlm's conversion (language model optionally
quantized to 2/3/4/6/8 bits, the vision tower kept in float), written through models/writing.staged_output so
an interrupted conversion never leaves a half model at --output-dir."""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from pathlib import Path

from mlx_grpo.base.errors import UserError
from mlx_grpo.models.writing import check_quantization, staged_output, write_record
from mlx_grpo.vlm.families import check_processor_files, family, is_vision_config, read_config


def flat_config(config: dict) -> dict:
    """Qwen2-VL / Qwen2.5-VL configs as transformers >= 5 saves them (text fields under text_config, RoPE
    under rope_parameters) in the flat form mlx-vlm reads (the hub checkpoints' own form)."""
    text = config.get("text_config")
    if config.get("model_type") not in ("qwen2_vl", "qwen2_5_vl") or not isinstance(text, dict) \
            or "hidden_size" in config:
        return config
    flat = {**{k: v for k, v in text.items() if k != "model_type"}, **config}
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if "mrope_section" in rope:
        flat["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    if "rope_theta" in rope:
        flat["rope_theta"] = rope["rope_theta"]
    flat.pop("text_config")
    # transformers names the tower's type qwen2_vl_vision; mlx-vlm's vision model checks for the family's own
    flat["vision_config"] = {**config.get("vision_config", {}), "model_type": config["model_type"]}
    return flat


def local_source(hf_path: str) -> Path:
    """A local directory for hf_path: itself, or the hub snapshot (needs huggingface_hub and the network)."""
    path = Path(hf_path).expanduser()
    if path.is_dir():
        return path
    if path.exists() or hf_path.count("/") != 1:
        raise UserError(f"--hf-path {hf_path!r}: no such directory (nor a hub id of the form owner/name)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(hf_path, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt",
                                                               "*.jinja", "*.tiktoken"]))
    except Exception as exc:
        raise UserError(f"could not fetch {hf_path!r} from the hub: {type(exc).__name__}: {exc}") from None


def is_vision_source(hf_path: str) -> bool:
    """Whether --hf-path names a vision-language model (local config.json, or the hub's)."""
    path = Path(hf_path).expanduser() / "config.json"
    if not path.is_file():
        if Path(hf_path).expanduser().exists() or hf_path.count("/") != 1:
            return False
        try:
            from huggingface_hub import hf_hub_download

            path = Path(hf_hub_download(hf_path, "config.json"))
        except Exception:  # unreachable hub or no such repo: the text converter reports it
            return False
    try:
        return is_vision_config(json.loads(path.read_text()))
    except (json.JSONDecodeError, OSError):
        return False


def convert_vlm(hf_path: str, output_dir: Path, *, quantize: bool, bits: int, group_size: int,
                dtype: str | None, trust_remote_code: bool, record: dict) -> str:
    """Convert a Hugging Face VLM with mlx-vlm into output_dir; -> its family (mlx-vlm model type)."""
    check_quantization(quantize, bits, group_size)
    source = local_source(hf_path)
    config = read_config(source)
    if not is_vision_config(config):
        raise UserError(f"{hf_path}: not a vision-language model (its config.json has no vision_config)")
    kind = family(config, hf_path)
    check_processor_files(source, hf_path)
    from mlx_vlm.convert import convert

    with tempfile.TemporaryDirectory(prefix="mlx-grpo-vlm-") as tmp:
        view = Path(tmp) / "source"  # the source's files with config.json in the form mlx-vlm reads
        view.mkdir()
        for item in source.iterdir():
            if item.name != "config.json":
                (view / item.name).symlink_to(item.resolve())
        (view / "config.json").write_text(json.dumps(flat_config(config), indent=2))
        with staged_output(Path(output_dir), prefix=".tmp-convert-") as staging:
            work = staging / "model"
            try:
                with contextlib.redirect_stdout(sys.stderr):  # mlx-vlm's [INFO] lines are progress, not output
                    convert(str(view), mlx_path=str(work), quantize=quantize, q_bits=bits,
                            q_group_size=group_size, dtype=dtype, trust_remote_code=trust_remote_code)
            except UserError:
                raise
            except Exception as exc:
                raise UserError(f"could not convert {hf_path!r}: {type(exc).__name__}: {exc}") from None
            for item in work.iterdir():  # the staging directory itself is what gets published
                item.rename(staging / item.name)
            work.rmdir()
            (staging / "README.md").unlink(missing_ok=True)  # mlx-vlm's hub model card
            write_record(staging, {**record, "vlm": kind})
    return kind
