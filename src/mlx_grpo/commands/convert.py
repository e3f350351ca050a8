"""`mlx-grpo convert`: Hugging Face (through mlx_lm.convert), GGUF or nanochat checkpoints to MLX model
directories."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from mlx_grpo.base.errors import UserError
from mlx_grpo.commands.vision_convert import is_vision_source
from mlx_grpo.models.writing import write_record


def convert_hf(hf_path: str, output_dir: Path, *, quantize: bool, bits: int, group_size: int,
               dtype: str | None, trust_remote_code: bool, record: dict) -> None:
    """Convert with mlx-lm into a temporary sibling directory, then rename (never a half model)."""
    from mlx_lm.convert import convert

    parent = output_dir.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=parent, prefix=".tmp-convert-"))
    try:
        work = staging / "model"  # mlx_lm.convert refuses an existing directory
        convert(hf_path, str(work), quantize=quantize, q_bits=bits if quantize else None,
                q_group_size=group_size if quantize else None, dtype=dtype,
                trust_remote_code=trust_remote_code)
        write_record(work, record)
        os.rename(work, output_dir)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"could not convert {hf_path!r}: {type(exc).__name__}: {exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _is_reward_model(hf_path: str) -> bool:
    """A *ForSequenceClassification checkpoint (local, or on the hub: its config.json is fetched first):
    mlx_lm.convert would drop its score head."""
    import json

    from mlx_grpo.rewards.reward_model import is_sequence_classifier

    config = Path(hf_path).expanduser() / "config.json"
    if not config.is_file():
        if Path(hf_path).expanduser().exists() or hf_path.count("/") != 1:
            return False  # not a hub id: mlx_lm.convert says what is wrong
        try:
            from huggingface_hub import hf_hub_download

            config = Path(hf_hub_download(hf_path, "config.json"))
        except Exception:  # unreachable hub or no such repo: mlx_lm.convert reports it
            return False
    return is_sequence_classifier(json.loads(config.read_text()))


def run_convert(hf_path: str | None = None, gguf: str | None = None, output_dir: str | None = None,
                quantize: bool = False, bits: int = 4, group_size: int = 64, dtype: str | None = None,
                trust_remote_code: bool = False, nanochat: str | None = None, step: int | None = None) -> Path:
    """Validate the flags, convert, and record the options in the output directory."""
    if sum(source is not None for source in (hf_path, gguf, nanochat)) != 1:
        raise UserError("give exactly one of --hf-path, --gguf or --nanochat")
    if step is not None and nanochat is None:
        raise UserError("--step applies to --nanochat only")
    if not output_dir:
        raise UserError("--output-dir is required")
    if group_size < 1:
        raise UserError("--group-size must be >= 1")
    out = Path(output_dir)
    if out.exists():
        raise UserError(f"output directory {out} already exists; choose another --output-dir or delete it")
    if trust_remote_code and hf_path is None:
        raise UserError("--trust-remote-code applies to --hf-path only: GGUF and nanochat files carry no code")
    # written into the staging directory by each converter, so it is published with the model
    record = {"hf_path": hf_path, "gguf": gguf, "nanochat": nanochat, "step": step, "quantize": quantize,
              "bits": bits, "group_size": group_size, "dtype": dtype, "trust_remote_code": trust_remote_code}
    if nanochat is not None:
        from mlx_grpo.models.nanochat import convert_nanochat

        convert_nanochat(nanochat, out, step=step, dtype=dtype, quantize=quantize, q_bits=bits,
                         q_group_size=group_size, record=record)
    elif gguf is not None:
        from mlx_grpo.models.gguf import convert_gguf

        convert_gguf(gguf, out, dtype=dtype or "bfloat16", quantize=quantize, q_bits=bits,
                     q_group_size=group_size, record={**record, "dtype": dtype or "bfloat16"})
    elif is_vision_source(hf_path):  # vision-language models go through mlx-vlm (commands/vision_convert.py)
        from mlx_grpo.commands.vision_convert import convert_vlm

        convert_vlm(hf_path, out, quantize=quantize, bits=bits, group_size=group_size, dtype=dtype,
                    trust_remote_code=trust_remote_code, record=record)
    elif _is_reward_model(hf_path):
        from mlx_grpo.rewards.reward_model import convert_reward_model

        convert_reward_model(hf_path, out, dtype=dtype, quantize=quantize, bits=bits, group_size=group_size,
                             record=record)
    else:
        convert_hf(hf_path, out, quantize=quantize, bits=bits, group_size=group_size, dtype=dtype,
                   trust_remote_code=trust_remote_code, record=record)
    return out
