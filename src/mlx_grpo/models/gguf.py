"""GGUF -> MLX model directory conversion (weights and config.json) for llama-family files.

Owns reading a llama.cpp GGUF file through MLX's native loader, dequantizing its tensors,
undoing llama.cpp's q/k RoPE row permutation, mapping tensor names to mlx_lm's llama model,
and writing the directory atomically. The tokenizer files come from `gguf_tokenizer`.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_grpo.base.errors import UserError
from mlx_grpo.models.gguf_tokenizer import build_tokenizer, write_tokenizer_files
from mlx_grpo.models.writing import (
    check_quantization,
    exists_error,
    mlx_dtype,
    save_mlx_model,
    staged_output,
    write_record,
)

_GGUF_GROUP_SIZE = 32  # Q4_0/Q4_1/Q8_0 blocks hold 32 weights; MLX keeps that as its group size

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")


def convert_gguf(
    gguf_path: str | Path,
    output_dir: str | Path,
    *,
    dtype: str = "bfloat16",
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    record: dict | None = None,
) -> Path:
    """Convert a llama-family GGUF file into an mlx_lm model directory and return its path;
    `record` (the convert options) is written into it as mlx_grpo_convert.json."""
    gguf_path, output_dir = Path(gguf_path), Path(output_dir)
    target = mlx_dtype(dtype)
    check_quantization(quantize, q_bits, q_group_size)
    if not gguf_path.is_file():
        raise UserError(f"GGUF file not found: {gguf_path}")
    if output_dir.exists():
        raise exists_error(output_dir)

    tensors, metadata = _read_gguf(gguf_path)
    config = build_config(metadata, tensors, gguf_path, dtype)
    tokenizer = build_tokenizer(metadata)  # before the slow part, so an unsupported vocab fails fast
    weights = convert_weights(tensors, config, target)

    with staged_output(output_dir) as tmp:
        _save_model(tmp, weights, config, quantize, q_bits, q_group_size)
        write_tokenizer_files(tokenizer, metadata, tmp, config)
        if record is not None:
            write_record(tmp, record)
    return output_dir


def _read_gguf(path: Path) -> tuple[dict, dict]:
    try:
        return mx.load(str(path), return_metadata=True)
    except (ValueError, RuntimeError, OSError) as e:
        raise UserError(
            f"cannot read GGUF file {path}: {e} (MLX reads F32, F16, BF16, Q4_0, Q4_1 and Q8_0 "
            "tensors; K-quants and other types must be re-quantized or taken from another file)"
        ) from e


def _meta(metadata: dict, key: str, default=None):
    """A metadata value as a Python scalar (MLX returns numeric scalars as 0-d arrays)."""
    value = metadata.get(key, default)
    if not (isinstance(value, mx.array) and value.ndim == 0):
        return value
    if value.dtype == mx.float32:  # shortest float32 repr: 1e-05, not 9.999999747378752e-06
        return float(str(np.float32(value.item())))
    return value.item()


def build_config(metadata: dict, tensors: dict, path: Path, dtype: str) -> dict:
    """The config.json for mlx_lm's llama model, from `llama.*` metadata and tensor shapes."""
    arch = _meta(metadata, "general.architecture")
    if arch != "llama":
        raise UserError(
            f"unsupported architecture {arch!r} in {path}: only llama-family GGUF files can be converted"
        )
    if _meta(metadata, "llama.expert_count", 0):
        raise UserError(f"mixture-of-experts llama GGUF files (Mixtral-style) are not supported: {path}")

    def need(key):
        value = _meta(metadata, f"llama.{key}")
        if value is None:
            raise UserError(f"GGUF file {path} lacks metadata 'llama.{key}'")
        return value

    n_heads = need("attention.head_count")
    hidden = need("embedding_length")
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": _meta(metadata, "llama.attention.head_count_kv", n_heads),
        "rms_norm_eps": need("attention.layer_norm_rms_epsilon"),
        "rope_theta": float(_meta(metadata, "llama.rope.freq_base", 10000.0)),
        "vocab_size": _vocab_size(tensors) or need("vocab_size"),
        "max_position_embeddings": _meta(metadata, "llama.context_length", 2048),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "torch_dtype": dtype,
    }
    head_dim = _meta(metadata, "llama.attention.key_length")
    if head_dim is not None:
        config["head_dim"] = head_dim
    rope_dims = _meta(metadata, "llama.rope.dimension_count")
    if rope_dims is not None and rope_dims != (head_dim or hidden // n_heads):
        raise UserError(f"partial rotary embeddings (rope dims {rope_dims}) are not supported: {path}")
    for key in ("bos_token_id", "eos_token_id"):
        token_id = _meta(metadata, f"tokenizer.ggml.{key}")
        if token_id is not None:
            config[key] = token_id
    scaling = _rope_scaling(metadata, tensors, config, path)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _vocab_size(tensors: dict) -> int | None:
    """Rows of the embedding (it can exceed the tokenizer's vocabulary when padded)."""
    embedding = tensors.get("token_embd.weight")
    return int(embedding.shape[0]) if embedding is not None else None


def _rope_scaling(metadata: dict, tensors: dict, config: dict, path: Path) -> dict | None:
    """Map llama.rope.scaling.* (or a llama-3 `rope_freqs` tensor) to an HF rope_scaling dict."""
    if "rope_freqs.weight" in tensors:
        return _llama3_scaling_from_factors(tensors["rope_freqs.weight"], config, path)
    kind = _meta(metadata, "llama.rope.scaling.type")
    factor = _meta(metadata, "llama.rope.scaling.factor")
    legacy = _meta(metadata, "llama.rope.scale_linear")  # pre-2024 key for linear scaling
    if kind is None and legacy is not None:
        kind, factor = "linear", legacy
    if kind in (None, "none") or (factor is not None and factor == 1.0 and kind == "linear"):
        return None
    if kind == "linear":
        return {"type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling = {"type": "yarn", "factor": float(factor)}
        orig = _meta(metadata, "llama.rope.scaling.original_context_length")
        if orig is not None:
            scaling["original_max_position_embeddings"] = orig
        return scaling
    raise UserError(f"unsupported RoPE scaling type {kind!r} in {path}")


def _llama3_scaling_from_factors(factors: mx.array, config: dict, path: Path) -> dict | None:
    """Recover llama-3 rope_scaling parameters from llama.cpp's per-frequency factor tensor.

    llama.cpp bakes Llama-3.1 scaling into `rope_freqs` (wavelength multipliers); mlx_lm wants the
    HF parameters, so fit them and check that they reproduce the tensor exactly."""
    f = factors.astype(mx.float32).tolist()
    factor = max(f)
    if factor <= 1.0 + 1e-6:
        return None  # all ones: no scaling
    dims = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    base = config["rope_theta"]
    wavelens = [2 * math.pi * base ** (2 * i / dims) for i in range(len(f))]
    # In the smooth band, s = (1/f - 1/factor) / (1 - 1/factor) is linear in 1/wavelen: s = a/w - b
    band = [(1 / w, (1 / x - 1 / factor) / (1 - 1 / factor)) for w, x in zip(wavelens, f) if 1 + 1e-4 < x < factor - 1e-4]
    if len(band) < 2:
        raise UserError(f"cannot map the rope_freqs tensor in {path} to a llama3 RoPE scaling")
    (x0, y0), (x1, y1) = band[0], band[-1]
    a = (y1 - y0) / (x1 - x0)
    b = a * x0 - y0
    # choose low_freq_factor = 1: the formula only depends on ratios, so this loses nothing
    scaling = {
        "rope_type": "llama3",
        "factor": round(factor, 6),
        "low_freq_factor": 1.0,
        "high_freq_factor": round(1.0 + 1.0 / b, 6),
        "original_max_position_embeddings": round(a / b),
    }
    if max(abs(x - y) / y for x, y in zip(_llama3_factors(wavelens, scaling), f)) > 1e-3:
        raise UserError(f"cannot map the rope_freqs tensor in {path} to a llama3 RoPE scaling")
    return scaling


def _llama3_factors(wavelens: list[float], s: dict) -> list[float]:
    """llama.cpp's rope_freqs formula for Llama-3 scaling (used to verify a fit)."""
    ctx, lo, hi, factor = s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"], s["factor"]
    out = []
    for w in wavelens:
        if w < ctx / hi:
            out.append(1.0)
        elif w > ctx / lo:
            out.append(factor)
        else:
            smooth = (ctx / w - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def convert_weights(tensors: dict, config: dict, dtype: mx.Dtype) -> dict[str, mx.array]:
    """HF/mlx_lm-named float weights: dequantized, q/k un-permuted, cast to `dtype`."""
    out = {}
    for name in tensors:
        if name.endswith((".scales", ".biases")) or name == "rope_freqs.weight":
            continue  # scales/biases are consumed with their weight; rope_freqs went into rope_scaling
        hf_name = hf_tensor_name(name)
        w = _dequantized(tensors, name)
        if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_qk(w, config["num_attention_heads"])
        elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_qk(w, config["num_key_value_heads"])
        out[hf_name] = w.astype(dtype)
    return out


def hf_tensor_name(name: str) -> str:
    """Map a GGUF tensor name (e.g. `blk.3.attn_q.weight`) to the mlx_lm llama parameter name."""
    if m := _BLOCK_RE.fullmatch(name):
        layer, part, kind = m.groups()
        if part in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    elif (m := _GLOBAL_RE.fullmatch(name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise UserError(f"unexpected tensor {name!r} in GGUF file: not part of a llama model")


def _dequantized(tensors: dict, name: str) -> mx.array:
    w = tensors[name]
    stem = name.rsplit(".", 1)[0]
    scales = tensors.get(f"{stem}.scales")
    if scales is None:
        return w
    biases = tensors[f"{stem}.biases"]
    in_features = scales.shape[-1] * _GGUF_GROUP_SIZE
    bits = w.shape[-1] * 32 // in_features
    # dequantize in float32 so the only rounding is the final cast to the target dtype
    scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
    return mx.dequantize(w, scales, biases, group_size=_GGUF_GROUP_SIZE, bits=bits)


def permute_qk(w: mx.array, n_heads: int) -> mx.array:
    """llama.cpp's HF->GGUF row permutation (halves-RoPE layout -> interleaved-RoPE layout)."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: mx.array, n_heads: int) -> mx.array:
    """Inverse of `permute_qk`, so mlx_lm's non-traditional RoPE sees HF's layout again."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _save_model(
    out: Path, weights: dict, config: dict, quantize: bool, q_bits: int, q_group_size: int
) -> None:
    from mlx_lm.models.llama import Model, ModelArgs

    save_mlx_model(out, Model(ModelArgs.from_dict(config)), weights, config, source="GGUF",
                   quantize=quantize, bits=q_bits, group_size=q_group_size)
