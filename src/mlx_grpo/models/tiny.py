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
