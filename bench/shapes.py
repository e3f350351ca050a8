"""Random-weight models in the shapes users actually train, for throughput and memory benchmarks: the
architecture of a real checkpoint (its config.json numbers) with weights drawn as Hugging Face
initializes them (normal, std 0.02; biases 0; norms 1), so nothing is downloaded.

  qwen2.5-0.5b   Qwen2.5-0.5B(-Instruct): hidden 896, 24 layers, 14 query / 2 KV heads (head dim 64)
  qwen2.5-1.5b   Qwen2.5-1.5B(-Instruct): hidden 1536, 28 layers, 12 query / 2 KV heads (head dim 128)
  tiny-qwen2     the same architecture at test size (CPU smoke tests)

Both Qwen2.5 shapes have the 151,936-token vocabulary and tie the output head to the embeddings; mlx-lm's
qwen2 model gives q/k/v projections a bias and o_proj none, as the checkpoints have. A shape needs no
tokenizer of its own for throughput: `write_model_dir` copies another model's tokenizer next to the
weights (the embedded SmolLM2's by default; its ids are < 49,152, valid in a 151,936 vocabulary).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import qwen2

from mlx_grpo.errors import UserError
from mlx_grpo.models.writing import copy_model_files

_QWEN25 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu",
           "vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
           "max_position_embeddings": 32768}

SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": {**_QWEN25, "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
                     "num_key_value_heads": 2, "intermediate_size": 4864},
    "qwen2.5-1.5b": {**_QWEN25, "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
                     "num_key_value_heads": 2, "intermediate_size": 8960},
    # Tests only: head dim 64 like the 0.5B, a vocabulary that holds the tests' byte-level tokenizer.
    "tiny-qwen2": {**_QWEN25, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                   "num_key_value_heads": 1, "intermediate_size": 256, "vocab_size": 512},
}
INIT_STD = 0.02  # Qwen2's initializer_range


def config(name: str) -> dict:
    """The config.json of shape `name` (a copy)."""
    if name not in SHAPES:
        raise UserError(f"unknown model shape {name!r}: choose one of {', '.join(SHAPES)}")
    return json.loads(json.dumps(SHAPES[name]))


def build(name: str, dtype: mx.Dtype = mx.bfloat16, seed: int = 0) -> nn.Module:
    """mlx-lm's qwen2 model of shape `name` with random weights in `dtype`, evaluated."""
    model = qwen2.Model(qwen2.ModelArgs.from_dict(config(name)))
    params = tree_flatten(model.parameters())  # still lazy: mlx-lm's own init is never computed
    keys = mx.random.split(mx.random.key(seed), len(params))
    drawn = []
    for (path, p), key in zip(params, keys):
        if path.endswith(".bias"):
            value = mx.zeros(p.shape, dtype=dtype)
        elif p.ndim == 2:  # projections and the (tied) embedding
            value = mx.random.normal(p.shape, dtype=dtype, scale=INIT_STD, key=key)
        else:  # RMSNorm weights
            value = mx.ones(p.shape, dtype=dtype)
        drawn.append((path, value))
    model.update(tree_unflatten(drawn))
    mx.eval(model.parameters())
    return model


def write_model_dir(name: str, target: Path, tokenizer_dir: Path, dtype: mx.Dtype = mx.bfloat16,
                    seed: int = 0) -> Path:
    """Write shape `name` as an MLX model directory (config.json, model.safetensors) that mlx-lm and the
    trainer load by path, with the tokenizer files of `tokenizer_dir` (and its EOS/BOS ids) next to it."""
    if not (tokenizer_dir / "tokenizer_config.json").is_file():
        raise UserError(f"no tokenizer in {tokenizer_dir} (tokenizer_config.json not found): give a model directory")
    source_config = tokenizer_dir / "config.json"
    source = json.loads(source_config.read_text()) if source_config.is_file() else {}
    cfg = config(name)
    if source.get("vocab_size", 0) > cfg["vocab_size"]:
        raise UserError(f"the tokenizer of {tokenizer_dir} has {source['vocab_size']} ids, more than shape "
                        f"{name}'s vocabulary of {cfg['vocab_size']}")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in source:
            cfg[key] = source[key]
    target.mkdir(parents=True, exist_ok=True)
    model = build(name, dtype, seed)
    mx.save_safetensors(str(target / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    del model
    (target / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    copy_model_files(tokenizer_dir, target)
    return target


def default_tokenizer_dir() -> Path:
    """The embedded default model's directory (converted once into the cache): its tokenizer."""
    from mlx_grpo.config import DEFAULT_MODEL
    from mlx_grpo.models.loading import resolve_model_path

    return Path(resolve_model_path(DEFAULT_MODEL))


def parameter_count(model: nn.Module) -> int:
    return sum(p.size for _, p in tree_flatten(model.parameters()))
