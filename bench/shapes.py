"""Random-weight models in the shapes users actually train, for throughput and memory benchmarks: the
architecture of a real checkpoint (its config.json numbers, built with mlx-lm's class for its model_type)
with weights drawn as Hugging Face initializes them (normal, std 0.02; biases 0; norms 1, Gemma's
offset norms 0), so nothing is downloaded.

  qwen2.5-0.5b   Qwen2.5-0.5B(-Instruct): hidden 896, 24 layers, 14 query / 2 KV heads (head dim 64)
  qwen2.5-1.5b   Qwen2.5-1.5B(-Instruct): hidden 1536, 28 layers, 12 query / 2 KV heads (head dim 128)
  qwen3-0.6b     Qwen3-0.6B: hidden 1024, 28 layers, 16 query / 8 KV heads (head dim 128), q/k RMSNorm
  qwen3.5-0.8b   Qwen3.5-0.8B, text model only: hidden 1024, 24 layers, 3 gated-delta (16 heads of 128)
                 to 1 gated attention (8 query / 2 KV heads, head dim 256, RoPE on a quarter of it)
  gemma-3-1b     gemma-3-1b-it: hidden 1152, 26 layers, 4 query / 1 KV head (head dim 256), 5 sliding-window
                 (512) layers to 1 global
  gemma-3-270m   gemma-3-270m: hidden 640, 18 layers, otherwise gemma-3-1b's attention
  lfm2-1.2b      LFM2-1.2B: hidden 2048, 16 layers, 10 short-convolution and 6 attention (32 query / 8 KV
                 heads, head dim 64)
  tiny-qwen2     the Qwen2.5 architecture at test size (CPU smoke tests)

Vocabularies are the real ones (Qwen2.5/Qwen3 151,936; Qwen3.5 248,320; Gemma 3 262,144; LFM2 65,536), and
every one of these checkpoints ties its output head to the embeddings. mlx-lm's qwen2 model gives q/k/v
projections a bias and o_proj none, as the checkpoints have. A shape needs no tokenizer of its own for
throughput: `write_model_dir` copies another model's tokenizer next to the weights (the embedded SmolLM2's
by default; its ids are < 49,152, valid in every vocabulary here).

Only llama-family shapes (qwen2.5-*, qwen3-0.6b) are served by the rollout engine's sampling copy and the
CUDA decode kernel (models/decoder.py supports); the others decode through generate_rollout on the model.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_grpo.base.errors import UserError
from mlx_grpo.models.writing import copy_model_files

# Values from each checkpoint's Hugging Face config.json (keys mlx-lm's ModelArgs does not read are kept where
# they say what the checkpoint is; from_dict ignores them).
_QWEN25 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu",
           "vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
           "max_position_embeddings": 32768}

# Qwen/Qwen3-0.6B config.json (https://huggingface.co/Qwen/Qwen3-0.6B/raw/main/config.json, as quoted verbatim
# in public repositories' fixtures).
_QWEN3_06B = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_act": "silu",
              "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128, "attention_bias": False, "rms_norm_eps": 1e-6,
              "rope_theta": 1000000, "rope_scaling": None, "max_position_embeddings": 40960,
              "tie_word_embeddings": True, "vocab_size": 151936}

# Qwen/Qwen3.5-0.8B config.json (model_type qwen3_5, Qwen3_5ForConditionalGeneration): its text_config only,
# the vision tower left out. mlx-lm's models/qwen3_5.py ModelArgs takes {model_type, text_config}; layer i is
# full (gated) attention when (i + 1) % full_attention_interval == 0, gated delta otherwise (= layer_types).
# Numbers as several public configs and ports of the checkpoint agree on them (no verbatim config.json was
# found in the indexed sources): hidden 1024, intermediate 3584, 24 layers, 8/2 heads of 256, linear 16/16
# heads of 128, conv kernel 4, rope_theta 1e7 on a 0.25 fraction (mrope [11, 11, 10]), tied, 248,320 ids.
_QWEN35_08B_TEXT = {
    "model_type": "qwen3_5_text", "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3584,
    "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
    "attention_bias": False, "attn_output_gate": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
    "full_attention_interval": 4,
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(24)],
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 16, "mamba_ssm_dtype": "float32",
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    "tie_word_embeddings": True, "vocab_size": 248320}

# google/gemma-3-1b-it config.json (Gemma3ForCausalLM, model_type gemma3_text; mlx-lm's gemma3_text defaults are
# this checkpoint's numbers too). Gemma's config omits tie_word_embeddings (transformers' default: tied);
# mlx-lm ties when the weights hold no lm_head. Every 6th layer attends globally (rope_theta), the others over
# a 512-token window (rope_local_base_freq).
_GEMMA3 = {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
           "hidden_activation": "gelu_pytorch_tanh", "num_attention_heads": 4, "num_key_value_heads": 1,
           "head_dim": 256, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
           "rope_local_base_freq": 10000, "rope_scaling": None, "sliding_window": 512, "sliding_window_pattern": 6,
           "attn_logit_softcapping": None, "final_logit_softcapping": None, "max_position_embeddings": 32768,
           "tie_word_embeddings": True, "vocab_size": 262144}

# LiquidAI/LFM2-1.2B config.json (Lfm2ForCausalLM, model_type lfm2): block_ff_dim 12288 with
# block_auto_adjust_ff_dim gives an MLP width of 256 * ceil(2/3 * 12288 / 256) = 8192, as mlx-lm computes it;
# attention at layers 2, 5, 8, 10, 12, 14 (full_attn_idxs), short convolutions (kernel 3) elsewhere; mlx-lm's
# lfm2 always uses the embedding as the output head.
_LFM2_ATTENTION = (2, 5, 8, 10, 12, 14)
_LFM2_12B = {"model_type": "lfm2", "architectures": ["Lfm2ForCausalLM"], "hidden_size": 2048, "block_dim": 2048,
             "num_hidden_layers": 16, "num_attention_heads": 32, "num_heads": 32, "num_key_value_heads": 8,
             "block_ff_dim": 12288, "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.0,
             "block_multiple_of": 256, "block_use_swiglu": True, "norm_eps": 1e-5, "block_norm_eps": 1e-5,
             "conv_L_cache": 3, "conv_bias": False, "conv_dim": 2048, "full_attn_idxs": list(_LFM2_ATTENTION),
             "layer_types": ["full_attention" if i in _LFM2_ATTENTION else "conv" for i in range(16)],
             "rope_theta": 1000000.0, "max_position_embeddings": 128000, "tie_embedding": True,
             "vocab_size": 65536}

SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": {**_QWEN25, "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
                     "num_key_value_heads": 2, "intermediate_size": 4864},
    "qwen2.5-1.5b": {**_QWEN25, "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
                     "num_key_value_heads": 2, "intermediate_size": 8960},
    "qwen3-0.6b": _QWEN3_06B,
    "qwen3.5-0.8b": {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
                     "tie_word_embeddings": True, "text_config": _QWEN35_08B_TEXT},
    "gemma-3-1b": {**_GEMMA3, "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26},
    # google/gemma-3-270m config.json: gemma-3-1b's attention at width 640, 18 layers (globals at 5, 11, 17)
    "gemma-3-270m": {**_GEMMA3, "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18},
    "lfm2-1.2b": _LFM2_12B,
    # Tests only: head dim 64 like the 0.5B, a vocabulary that holds the tests' byte-level tokenizer.
    "tiny-qwen2": {**_QWEN25, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                   "num_key_value_heads": 1, "intermediate_size": 256, "vocab_size": 512},
}
INIT_STD = 0.02  # every family's initializer_range


def _text(cfg: dict) -> dict:
    """The part of a config that describes the language model (Qwen3.5's text_config, else the config)."""
    return cfg.get("text_config", cfg)


def vocab_size(cfg: dict) -> int:
    return _text(cfg)["vocab_size"]


def config(name: str, layers: int = 0) -> dict:
    """The config.json of shape `name` (a copy); layers > 0 keeps only its first `layers` layers (the layer
    kinds in their real order: quick checks on small machines)."""
    if name not in SHAPES:
        raise UserError(f"unknown model shape {name!r}: choose one of {', '.join(SHAPES)}")
    cfg = json.loads(json.dumps(SHAPES[name]))
    text = _text(cfg)
    if layers:
        if not 0 < layers <= text["num_hidden_layers"]:
            raise UserError(f"shape {name} has {text['num_hidden_layers']} layers: cannot keep {layers}")
        text["num_hidden_layers"] = layers
        if "layer_types" in text:
            text["layer_types"] = text["layer_types"][:layers]
        if "full_attn_idxs" in text:
            text["full_attn_idxs"] = [i for i in text["full_attn_idxs"] if i < layers]
    return cfg


def _tied(cfg: dict) -> bool:
    return bool(cfg.get("tie_word_embeddings", _text(cfg).get("tie_word_embeddings", False)))


def _offset_norm(module) -> bool:
    """Gemma's RMSNorm scales by 1 + weight (Hugging Face initializes its weight to 0)."""
    return type(module).__name__ == "RMSNorm" and type(module).__module__.startswith("mlx_lm.models.gemma")


def build(name: str, dtype: mx.Dtype = mx.bfloat16, seed: int = 0, layers: int = 0) -> nn.Module:
    """mlx-lm's model of shape `name` (its model_type's class) with random weights in `dtype`, evaluated.
    Projections, embeddings and convolution kernels are drawn (normal, INIT_STD), biases are 0, Gemma's
    offset norms 0; other vectors keep mlx-lm's own initial values (norms 1; Qwen3.5's gated-delta A_log
    and dt_bias as Hugging Face draws them), and A_log stays float32 as mlx-lm's conversion keeps it."""
    cfg = config(name, layers)
    module = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    mx.random.seed(seed)  # mlx-lm's own random vectors (A_log)
    model = module.Model(module.ModelArgs.from_dict(cfg))
    params = dict(tree_flatten(model.parameters()))  # still lazy: mlx-lm's own matrices are never computed
    if _tied(cfg):
        params.pop("lm_head.weight", None)
    if hasattr(model, "sanitize"):  # as mlx-lm's load does: gemma3_text ties its head when lm_head is absent
        params = model.sanitize(params)
    keep_dtype = getattr(model, "cast_predicate", lambda _: True)
    owners = dict(model.named_modules())
    keys = mx.random.split(mx.random.key(seed), len(params))
    drawn = []
    for (path, p), key in zip(params.items(), keys):
        owner = owners.get(path.rpartition(".")[0])
        if path.endswith(".bias"):
            value = mx.zeros(p.shape)
        elif p.ndim >= 2:  # projections, the (tied) embedding, depthwise convolution kernels
            value = mx.random.normal(p.shape, dtype=dtype, scale=INIT_STD, key=key)
        elif _offset_norm(owner):
            value = mx.zeros(p.shape)
        else:  # RMSNorm weights (1), gated-delta A_log / dt_bias
            value = p
        drawn.append((path, value.astype(dtype if keep_dtype(path) else mx.float32)))
    model.load_weights(drawn, strict=True)
    mx.eval(model.parameters())
    return model


def write_model_dir(name: str, target: Path, tokenizer_dir: Path, dtype: mx.Dtype = mx.bfloat16,
                    seed: int = 0, layers: int = 0) -> Path:
    """Write shape `name` (its first `layers` layers if > 0) as an MLX model directory (config.json,
    model.safetensors) that mlx-lm and the trainer load by path, with the tokenizer files of `tokenizer_dir`
    (and its EOS/BOS ids) next to it."""
    if not (tokenizer_dir / "tokenizer_config.json").is_file():
        raise UserError(f"no tokenizer in {tokenizer_dir} (tokenizer_config.json not found): give a model directory")
    source_config = tokenizer_dir / "config.json"
    source = json.loads(source_config.read_text()) if source_config.is_file() else {}
    cfg = config(name, layers)
    if source.get("vocab_size", 0) > vocab_size(cfg):
        raise UserError(f"the tokenizer of {tokenizer_dir} has {source['vocab_size']} ids, more than shape "
                        f"{name}'s vocabulary of {vocab_size(cfg)}")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in source:
            cfg[key] = source[key]
    target.mkdir(parents=True, exist_ok=True)
    model = build(name, dtype, seed, layers)
    mx.save_safetensors(str(target / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    del model
    (target / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    copy_model_files(tokenizer_dir, target)
    return target


def default_tokenizer_dir() -> Path:
    """The embedded default model's directory (converted once into the cache): its tokenizer."""
    from mlx_grpo.config import DEFAULT_MODEL
    from mlx_grpo.models.model_loading import resolve_model_path

    return Path(resolve_model_path(DEFAULT_MODEL))


def parameter_count(model: nn.Module) -> int:
    return sum(p.size for _, p in tree_flatten(model.parameters()))
