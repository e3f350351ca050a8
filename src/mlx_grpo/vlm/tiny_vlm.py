"""Tiny random-weight Qwen2-VL models written with transformers (torch, CPU) into a Hugging Face directory,
with a byte-level tokenizer, the Qwen2-VL image processor and a chat template that takes images: what the
VLM tests convert and train, and what bench/vlm_bench.py --tiny runs, with nothing downloaded."""

from __future__ import annotations

import json
from pathlib import Path

from mlx_grpo.models.tiny import write_tokenizer

# Qwen2-VL's vision specials, given ids after the byte tokens (the chat template below places them)
VISION_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# Qwen2-VL's own template, reduced to what the tiny tokenizer needs: string or [{type: image|text}] content
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_vlm(path: Path, seed: int = 0, hidden: int = 32, layers: int = 2, vision_depth: int = 1,
                   vision_dim: int = 32, max_pixels: int = 56 * 56) -> Path:
    """A Hugging Face Qwen2-VL directory at path (created): `layers` text layers of width `hidden`, a vision
    tower of `vision_depth` blocks, random weights from `seed`; images are resized to at most max_pixels
    (56x56: 16 patches of 14 -> 4 image tokens). -> path."""
    import torch
    from tokenizers import Tokenizer
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # the embedding is padded to a multiple of 64 rows, as Qwen's own are (mlx-vlm quantizes only such tables)
    vocab = -(-write_tokenizer(path, extra_specials=VISION_SPECIALS) // 64) * 64
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = {name: tok.token_to_id(name) for name in VISION_SPECIALS}
    config_file = path / "tokenizer_config.json"
    tok_config = json.loads(config_file.read_text())
    tok_config.update(chat_template=VLM_CHAT_TEMPLATE, image_token="<|image_pad|>", video_token="<|video_pad|>",
                      extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"})
    config_file.write_text(json.dumps(tok_config))
    (path / "chat_template.json").write_text(json.dumps({"chat_template": VLM_CHAT_TEMPLATE}))
    heads = max(2, hidden // 128)  # 128-wide heads as Qwen2-VL's (2 for the tests' width 32)
    kv_heads = max(1, heads // 6)
    head_dim = hidden // heads
    config = Qwen2VLConfig(
        text_config={"hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": 2 * hidden,
                     "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab,
                     "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                     "tie_word_embeddings": True, "eos_token_id": 2,
                     # the three mrope sections (temporal, height, width) cover head_dim / 2 frequencies
                     "rope_scaling": {"type": "mrope", "mrope_section": [head_dim // 4, head_dim // 8,
                                                                         head_dim // 8]}},
        vision_config={"depth": vision_depth, "embed_dim": vision_dim, "hidden_size": hidden,
                       "num_heads": max(2, vision_dim // 80),
                       "mlp_ratio": 2, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "in_channels": 3},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True, eos_token_id=2)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    processor = Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=max_pixels, patch_size=14, merge_size=2,
                                      temporal_patch_size=2)
    processor.save_pretrained(path)
    pre = json.loads((path / "preprocessor_config.json").read_text())
    (path / "preprocessor_config.json").write_text(json.dumps({**pre, "processor_class": "Qwen2VLProcessor"}))
    return path
