"""Tiny random-weight llama models with a byte-level tokenizer and a ChatML template: what the tests and the
benches (bench/crash_resume.py --tiny) train in seconds, from the base install (mlx-lm, tokenizers)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_tokenizer(path: Path, extra_specials: tuple[str, ...] = ()) -> int:
    """A byte-level BPE tokenizer without merges (one token per byte) plus ChatML specials (and
    extra_specials, given ids after the bytes), written into path; -> its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):  # alphabet() order varies per process
        vocab[ch] = len(vocab)
    for special in extra_specials:
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL + list(extra_specials))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML,
        "clean_up_tokenization_spaces": False, "model_max_length": 2048}))
    return len(vocab)


def write_tiny_model(path: Path, seed: int = 0, hidden: int = 32, layers: int = 2) -> Path:
    """An MLX model directory at path (created): a llama of `layers` layers of width `hidden`, random weights
    drawn from `seed`, and write_tokenizer's tokenizer; -> path."""
    from mlx_lm.models import llama

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tokenizer(path)
    config = {"model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers,
              "intermediate_size": 2 * hidden, "num_attention_heads": 2, "num_key_value_heads": 1,
              "rms_norm_eps": 1e-5, "vocab_size": vocab_size, "rope_theta": 10000.0,
              "tie_word_embeddings": True, "max_position_embeddings": 2048, "eos_token_id": 2}
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config))
    return path


# Tiny configurations of the model families people fine-tune, each built with mlx-lm's own classes: the
# family matrix (tests/test_families.py) runs one GRPO update on each. Every layer kind of the family is
# present (recurrent + attention, sliding + full, KV-shared, experts), at width 32.
_ATTN = {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
         "intermediate_size": 64, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "rope_theta": 10000.0}
_GATED_DELTA = {"linear_num_value_heads": 2, "linear_num_key_heads": 1, "linear_key_head_dim": 16,
                "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "full_attention_interval": 2}
FAMILY_CONFIGS = {
    "llama": {**_ATTN, "num_hidden_layers": 2, "tie_word_embeddings": True},
    "qwen2": {**_ATTN, "num_hidden_layers": 2, "tie_word_embeddings": True},
    "qwen3": {**_ATTN, "num_hidden_layers": 2, "tie_word_embeddings": True},
    "phi3": {**_ATTN, "num_hidden_layers": 2, "num_key_value_heads": 2},
    "qwen3_5": {**_ATTN, **_GATED_DELTA, "num_hidden_layers": 4, "tie_word_embeddings": True,
                "rope_parameters": {"type": "default", "mrope_section": [2, 2, 0], "rope_theta": 10000.0,
                                    "partial_rotary_factor": 0.25}},
    "qwen3_next": {**_ATTN, **_GATED_DELTA, "num_hidden_layers": 4, "partial_rotary_factor": 0.25,
                   "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
                   "shared_expert_intermediate_size": 32, "mlp_only_layers": [], "moe_intermediate_size": 32},
    "qwen3_moe": {**_ATTN, "num_hidden_layers": 2, "num_experts": 4, "num_experts_per_tok": 2,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 32,
                  "tie_word_embeddings": False, "norm_topk_prob": True},
    "gemma3_text": {**_ATTN, "num_hidden_layers": 3, "query_pre_attn_scalar": 16, "sliding_window": 8,
                    "sliding_window_pattern": 3, "rope_local_base_freq": 10000.0},
    # the released small Gemma 4 shape: the last layers reuse earlier layers' keys and values
    "gemma4_text": {**_ATTN, "num_hidden_layers": 4, "global_head_dim": 16, "num_kv_shared_layers": 2,
                    "hidden_size_per_layer_input": 8, "sliding_window": 8, "sliding_window_pattern": 2,
                    "use_double_wide_mlp": True, "final_logit_softcapping": 30.0},
    "lfm2": {**_ATTN, "num_hidden_layers": 3, "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3,
             "block_dim": 32, "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.0,
             "block_auto_adjust_ff_dim": False, "block_ff_dim": 64,
             "layer_types": ["conv", "full_attention", "conv"]},
    "granitemoehybrid": {**_ATTN, "num_hidden_layers": 3, "attention_bias": False, "embedding_multiplier": 12.0,
                         "attention_multiplier": 0.25, "logits_scaling": 4.0, "residual_multiplier": 0.25,
                         "layer_types": ["mamba", "attention", "mamba"], "mamba_n_heads": 4, "mamba_d_head": 16,
                         "mamba_proj_bias": False, "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_n_groups": 1,
                         "mamba_conv_bias": True, "shared_intermediate_size": 64},
    "gpt_oss": {**_ATTN, "num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
                "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    "nanochat": {**_ATTN, "num_hidden_layers": 2, "num_key_value_heads": 2},
}


EMBEDDING_SCALE = 0.25


def write_tiny_family(path: Path, family: str, seed: int = 0, overrides: dict | None = None) -> Path:
    """An MLX model directory at path (created): mlx-lm's `family` (a key of FAMILY_CONFIGS) at its tiny
    configuration updated by `overrides`, random weights drawn from `seed`, and write_tokenizer's
    tokenizer; -> path."""
    import importlib

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tokenizer(path)
    config = {**FAMILY_CONFIGS[family], "model_type": family, "vocab_size": vocab_size,
              "vocab_size_per_layer_input": vocab_size, "eos_token_id": 2, "pad_token_id": 0, **(overrides or {})}
    module = importlib.import_module(f"mlx_lm.models.{family}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    # mlx-lm draws embeddings from N(0, 1): with Gemma's sqrt(width) embedding scale and a tied head that gives
    # log-probs near -50, whose float32 rounding alone approaches the matrix's 1e-5 bound. A quarter of that
    # keeps the distributions peaked (padding tests need no near-ties) at the log-prob scale of real models.
    weights = {k: v * EMBEDDING_SCALE if k.endswith("embed_tokens.weight") or k.endswith("wte.weight") else v
               for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config))
    return path
