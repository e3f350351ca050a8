"""nanochat checkpoints -> MLX model directories for mlx-lm's `nanochat` model type.

Owns finding `model_<step>.pt`, `meta_<step>.json` and `tokenizer.pkl` in a checkpoint directory,
reading the weights with PyTorch (an optional extra, `weights_only` so the .pt runs no pickle code),
refusing checkpoints of the newer nanochat design that mlx-lm's model does not implement, mapping
`meta["model_config"]` to mlx-lm's config, and writing the directory. The tokenizer files come from
`nanochat_tokenizer`.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_grpo.base.errors import UserError
from mlx_grpo.models.nanochat_tokenizer import (
    BOS,
    TiktokenState,
    eos_token_ids,
    read_tiktoken_pickle,
    write_hf_tokenizer,
)
from mlx_grpo.models.writing import (
    check_quantization,
    exists_error,
    mlx_dtype,
    save_mlx_model,
    staged_output,
    write_record,
)

TORCH_HINT = "pip install 'mlx-grpo[nanochat]' (or: pip install torch)"
_MODEL_FILE = re.compile(r"model_(\d+)\.pt")
_COMPILED_PREFIX = "_orig_mod."  # torch.compile wraps the model; nanochat saves the wrapper's keys
# GPTConfig of the original (October 2025) design, the one mlx-lm's nanochat model implements.
_CONFIG_KEYS = {"sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd"}
# What the newer design (value embeddings, per-layer lambdas, smear, backout, sliding windows) adds.
_NEWER_DESIGN_MARKERS = ("value_embeds", "ve_gate", "resid_lambdas", "x0_lambdas", "smear", "backout",
                         "window_pattern")
ROPE_THETA = 10000.0  # nanochat's _precompute_rotary_embeddings base


def find_checkpoint(directory: Path, step: int | None) -> tuple[Path, Path, int]:
    """(model_<step>.pt, meta_<step>.json, step): the latest step unless one is asked for."""
    if not directory.is_dir():
        raise UserError(f"nanochat checkpoint directory not found: {directory}")
    found = {}
    for path in directory.iterdir():
        match = _MODEL_FILE.fullmatch(path.name)
        if match:
            number = int(match.group(1))
            if number in found:
                raise UserError(f"{directory}: {found[number].name} and {path.name} are both step {number}; "
                                "keep one")
            found[number] = path
    if not found:
        raise UserError(f"{directory}: no model_<step>.pt file (not a nanochat checkpoint directory)")
    if step is None:
        step = max(found)
    elif step not in found:
        raise UserError(f"{directory}: no checkpoint for --step {step}; steps present: "
                        f"{', '.join(str(s) for s in sorted(found))}")
    model_path = found[step]
    meta_path = directory / model_path.name.replace("model_", "meta_").replace(".pt", ".json")
    if not meta_path.is_file():
        raise UserError(f"{directory}: {model_path.name} has no {meta_path.name} beside it "
                        "(nanochat writes both; the model config is in the meta file)")
    return model_path, meta_path, step


def read_model_config(meta_path: Path) -> dict:
    """meta["model_config"], checked to be the original design's GPTConfig."""
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{meta_path}: not a readable JSON file ({e})") from None
    config = meta.get("model_config") if isinstance(meta, dict) else None
    if not isinstance(config, dict):
        raise UserError(f"{meta_path}: no 'model_config' object (not a nanochat meta file)")
    newer = sorted(k for k in config if k.startswith(_NEWER_DESIGN_MARKERS))
    if newer or set(config) - _CONFIG_KEYS:
        raise _unsupported(meta_path, newer or sorted(set(config) - _CONFIG_KEYS), "model_config keys")
    missing = sorted(_CONFIG_KEYS - set(config))
    bad = [k for k in _CONFIG_KEYS & set(config) if type(config[k]) is not int or config[k] < 1]
    if missing or bad:
        raise UserError(f"{meta_path}: model_config lacks {missing} or has non-positive-integer values "
                        f"{sorted(bad)}")
    if config["n_embd"] % config["n_head"] or config["n_head"] % config["n_kv_head"]:
        raise UserError(f"{meta_path}: n_embd must divide by n_head and n_head by n_kv_head")
    if (config["n_embd"] // config["n_head"]) % 2:
        raise UserError(f"{meta_path}: the head dimension n_embd / n_head must be even (rotary embeddings "
                        "rotate pairs of channels)")
    return config


def _unsupported(source: Path, found: list[str], what: str) -> UserError:
    return UserError(
        f"{source}: unsupported nanochat version: {what} {', '.join(found[:6])}"
        f"{' ...' if len(found) > 6 else ''} belong to a newer nanochat design (value embeddings, smear, "
        "backout, sliding-window attention or per-layer lambdas), which mlx-lm's nanochat model does not "
        "implement; only checkpoints of the original October-2025 design convert")


def read_state_dict(model_path: Path) -> tuple[dict[str, np.ndarray], set[str]]:
    """The checkpoint's tensors as float numpy arrays (`_orig_mod.` prefixes stripped) and the
    float types they were stored in."""
    try:
        import torch
    except ImportError:
        raise UserError(f"reading nanochat .pt checkpoints needs PyTorch: {TORCH_HINT}") from None
    try:
        # weights_only: torch's restricted unpickler, so a hostile .pt cannot run code
        state = torch.load(model_path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:  # torch's own text suggests weights_only=False: not for us to offer
        raise UserError(f"{model_path}: refusing to load: the checkpoint asks for objects other than "
                        "tensors (a nanochat model file holds only a state dict; the file may be malicious)") from None
    except Exception as e:  # truncated or foreign files raise RuntimeError, OSError, ...
        raise UserError(f"{model_path}: could not read the checkpoint ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{model_path}: expected a state dict of tensors (what nanochat's save_checkpoint "
                        "writes)")
    floats = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    out = {}
    for key, tensor in state.items():
        name = key.removeprefix(_COMPILED_PREFIX)
        if name in out:
            raise UserError(f"{model_path}: tensor {name} appears twice (with and without {_COMPILED_PREFIX})")
        if tensor.dtype not in floats:
            raise UserError(f"{model_path}: tensor {name} is {tensor.dtype}; expected float16, bfloat16, "
                            "float32 or float64")
        # numpy has no bfloat16: widen it (exactly) to float32; float16/32 stay as they are
        out[name] = (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()
    return out, {str(t.dtype).removeprefix("torch.") for t in state.values()}


def expected_shapes(config: dict, vocab_rows: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the original design, by nanochat's names (which mlx-lm's model reuses)."""
    d, head_dim = config["n_embd"], config["n_embd"] // config["n_head"]
    shapes = {"transformer.wte.weight": (vocab_rows, d), "lm_head.weight": (vocab_rows, d)}
    for i in range(config["n_layer"]):
        p = f"transformer.h.{i}"
        shapes.update({
            f"{p}.attn.c_q.weight": (config["n_head"] * head_dim, d),
            f"{p}.attn.c_k.weight": (config["n_kv_head"] * head_dim, d),
            f"{p}.attn.c_v.weight": (config["n_kv_head"] * head_dim, d),
            f"{p}.attn.c_proj.weight": (d, d),
            f"{p}.mlp.c_fc.weight": (hidden, d),
            f"{p}.mlp.c_proj.weight": (d, hidden),
        })
    return shapes


def check_tensors(tensors: dict[str, np.ndarray], config: dict, model_path: Path) -> dict:
    """Refuse the newer design and anything else unexpected; crop padded vocabulary rows (in place);
    return the mlx-lm config."""
    newer = sorted(k for k in tensors if any(m in k for m in _NEWER_DESIGN_MARKERS))
    if newer:
        raise _unsupported(model_path, newer, "tensors")
    wte, fc = tensors.get("transformer.wte.weight"), tensors.get("transformer.h.0.mlp.c_fc.weight")
    if wte is None or fc is None:
        raise UserError(f"{model_path}: no transformer.wte / transformer.h.0.mlp.c_fc weights "
                        "(not a nanochat GPT state dict)")
    layers = {int(m.group(1)) for k in tensors if (m := re.match(r"transformer\.h\.(\d+)\.", k))}
    if layers != set(range(config["n_layer"])):  # before building n_layer expectations from the meta file
        raise UserError(f"{model_path}: the checkpoint has {len(layers)} layers, meta's model_config says "
                        f"n_layer={config['n_layer']}")
    expected = expected_shapes(config, wte.shape[0], fc.shape[0])
    extra, missing = sorted(set(tensors) - set(expected)), sorted(set(expected) - set(tensors))
    if extra or missing:
        raise UserError(f"{model_path}: tensors do not match the original nanochat design with "
                        f"n_layer={config['n_layer']}: unexpected {extra[:6]}, missing {missing[:6]}")
    wrong = [f"{k} {tensors[k].shape} (expected {shape})" for k, shape in expected.items()
             if tuple(tensors[k].shape) != shape]
    if wrong:
        raise UserError(f"{model_path}: tensor shapes do not match meta's model_config: {'; '.join(wrong[:4])}")
    if wte.shape[0] < config["vocab_size"]:
        raise UserError(f"{model_path}: the embedding has {wte.shape[0]} rows for a vocab_size of "
                        f"{config['vocab_size']}")
    # rows past vocab_size are padding that nanochat crops from its logits: drop them here
    for name in ("transformer.wte.weight", "lm_head.weight"):
        tensors[name] = tensors[name][: config["vocab_size"]]
    return {
        "model_type": "nanochat",
        "hidden_size": config["n_embd"],
        "num_hidden_layers": config["n_layer"],
        "num_attention_heads": config["n_head"],
        "num_key_value_heads": config["n_kv_head"],
        "vocab_size": config["vocab_size"],
        "max_position_embeddings": config["sequence_len"],
        "intermediate_size": int(fc.shape[0]),
        "rope_theta": ROPE_THETA,
        "tie_word_embeddings": False,
    }


def _default_dtype(source_dtypes: set[str]) -> str:
    """The widest float type stored (nanochat keeps bf16 embeddings beside fp32 matrices): no loss."""
    for name in ("float32", "float16", "bfloat16"):
        if name in source_dtypes:
            return name
    return "float32"


def write_nanochat_model(output_dir: Path, tensors: dict[str, np.ndarray], nano_config: dict,
                         tokenizer: TiktokenState, *, source: str, tokenizer_source: str, dtype: str,
                         quantize: bool = False, q_bits: int = 4, q_group_size: int = 64,
                         record: dict | None = None) -> Path:
    """Check nanochat tensors (original design) against their model_config and tokenizer, then write
    the mlx-lm model directory atomically. Used by convert and by the benchmark's random models.
    `tensors` is emptied as it is converted, so the numpy copies are freed before the save."""
    from mlx_lm.models.nanochat import Model, ModelArgs

    config = check_tensors(tensors, nano_config, Path(source))
    tokens = len(tokenizer.mergeable_ranks) + len(tokenizer.special_tokens)
    top_id = max([*tokenizer.mergeable_ranks.values(), *tokenizer.special_tokens.values()])
    if tokens != config["vocab_size"] or top_id != tokens - 1:  # nanochat: vocab_size = tokenizer size
        raise UserError(f"{tokenizer_source}: {tokens} tokens (ids up to {top_id}) for a model vocab_size of "
                        f"{config['vocab_size']}: a tokenizer from another run?")
    target = mlx_dtype(dtype)
    weights = {k: mx.array(tensors.pop(k)).astype(target) for k in list(tensors)}
    config.update(eos_token_id=eos_token_ids(tokenizer), bos_token_id=tokenizer.special_tokens[BOS],
                  torch_dtype=dtype)
    with staged_output(output_dir) as tmp:
        save_mlx_model(tmp, Model(ModelArgs.from_dict(config)), weights, config, source=source,
                       quantize=quantize, bits=q_bits, group_size=q_group_size)
        write_hf_tokenizer(tokenizer, tmp)
        if record is not None:
            write_record(tmp, {**record, "dtype": dtype})
    return output_dir


def convert_nanochat(directory: str | Path, output_dir: str | Path, *, step: int | None = None,
                     dtype: str | None = None, quantize: bool = False, q_bits: int = 4,
                     q_group_size: int = 64, record: dict | None = None) -> tuple[Path, int]:
    """Convert a nanochat checkpoint directory into an mlx-lm model directory; -> (path, step).
    `record` (the convert options) is written into it, with the step and dtype actually used."""
    directory, output_dir = Path(directory), Path(output_dir)
    if dtype is not None:
        mlx_dtype(dtype)
    check_quantization(quantize, q_bits, q_group_size)
    if output_dir.exists():
        raise exists_error(output_dir)
    model_path, meta_path, step = find_checkpoint(directory, step)
    nano_config = read_model_config(meta_path)
    tokenizer_path = directory / "tokenizer.pkl"
    if not tokenizer_path.is_file():
        raise UserError(f"{directory}: no tokenizer.pkl; nanochat keeps it in $NANOCHAT_BASE_DIR/tokenizer/ "
                        "(default ~/.cache/nanochat/tokenizer/tokenizer.pkl): copy it beside the checkpoint")
    # the tokenizer first: a refused pickle or a non-nanochat vocabulary fails before the slow part
    tokenizer = read_tiktoken_pickle(tokenizer_path)
    eos_token_ids(tokenizer)  # raises if nanochat's special tokens are missing
    tensors, source_dtypes = read_state_dict(model_path)
    write_nanochat_model(output_dir, tensors, nano_config, tokenizer, source=str(model_path),
                         tokenizer_source=str(tokenizer_path), dtype=dtype or _default_dtype(source_dtypes), quantize=quantize, q_bits=q_bits,
                         q_group_size=q_group_size, record=None if record is None else {**record, "step": step})
    return output_dir, step
