"""Tiny nanochat artefacts built in the tests: a BPE-trained tiktoken Encoding with nanochat's 9
special tokens, and a random-weight checkpoint directory laid out as nanochat's checkpoint_manager
writes it (model_<step>.pt with torch.compile's `_orig_mod.` keys, meta_<step>.json, tokenizer.pkl)."""

from __future__ import annotations

import json
import pickle
from collections import Counter
from pathlib import Path

import numpy as np
import regex

from mlx_grpo.models.nanochat_tokenizer import SPECIAL_TOKENS

# nanochat/tokenizer.py SPLIT_PATTERN (GPT-4's, with \p{N}{1,2})
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)

CORPUS = (
    "The quick brown fox jumps over the lazy dog. They're here, we've seen it, I'll go, she'd say.\n"
    "Numbers: 12 345 6789 2024-11-22, 3.14159 and 1000000!\n\n"
    "def f(x):\n    return x * 2  # the answer\n\t\tindented   spaces\n"
    "café naïve résumé — “quotes” … 你好世界，你好！こんにちは 🙂🎉🙂🎉 👍🏽\n"
) * 3

CONFIG = {"sequence_len": 128, "vocab_size": 0, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 64}


def train_ranks(text: str, n_merges: int) -> dict[bytes, int]:
    """Plain BPE training (most frequent pair, ties by bytes) on regex chunks, as rustbpe does."""
    words = Counter(tuple(bytes([b]) for b in chunk.encode()) for chunk in regex.findall(SPLIT_PATTERN, text))
    ranks = {bytes([b]): b for b in range(256)}
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        merged: Counter = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return ranks


def make_encoding(n_merges: int = 120):
    import tiktoken

    ranks = train_ranks(CORPUS, n_merges)
    # a hand-added token no merge sequence reaches: tiktoken still emits it for a whole regex piece
    ranks[b" zyxwv"] = len(ranks)
    specials = {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
    return tiktoken.Encoding(name="rustbpe", pat_str=SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


def random_state_dict(config: dict, vocab_rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    """nanochat GPT weights (original design) as float32 numpy arrays, scaled as nanochat initialises
    them, except a larger lm_head so that logits reach the 15-softcap's non-linear range."""
    rng = np.random.default_rng(seed)
    d, hidden = config["n_embd"], 4 * config["n_embd"]
    head_dim = d // config["n_head"]

    def linear(out_f, in_f, scale=1.0):
        return (rng.standard_normal((out_f, in_f)) * scale / np.sqrt(in_f)).astype(np.float32)

    state = {"transformer.wte.weight": rng.standard_normal((vocab_rows, d)).astype(np.float32)}
    for i in range(config["n_layer"]):
        p = f"transformer.h.{i}"
        state[f"{p}.attn.c_q.weight"] = linear(config["n_head"] * head_dim, d)
        state[f"{p}.attn.c_k.weight"] = linear(config["n_kv_head"] * head_dim, d)
        state[f"{p}.attn.c_v.weight"] = linear(config["n_kv_head"] * head_dim, d)
        state[f"{p}.attn.c_proj.weight"] = linear(d, d)
        state[f"{p}.mlp.c_fc.weight"] = linear(hidden, d)
        state[f"{p}.mlp.c_proj.weight"] = linear(d, hidden)
    state["lm_head.weight"] = linear(vocab_rows, d, scale=25.0)
    return state


def write_checkpoint(directory: Path, state: dict[str, np.ndarray], config: dict, step: int,
                     encoding=None, extra_meta: dict | None = None) -> Path:
    """Save as nanochat does: torch.compile's key prefix, the embedding in bfloat16 (nanochat casts
    wte to bf16), the rest float32."""
    import torch

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, array in state.items():
        tensor = torch.from_numpy(array.copy())
        tensors[f"_orig_mod.{name}"] = tensor.bfloat16() if name == "transformer.wte.weight" else tensor
    torch.save(tensors, directory / f"model_{step:06d}.pt")
    meta = {"step": step, "val_bpb": 1.0, "model_config": config, **(extra_meta or {})}
    (directory / f"meta_{step:06d}.json").write_text(json.dumps(meta))
    if encoding is not None:
        with open(directory / "tokenizer.pkl", "wb") as f:
            pickle.dump(encoding, f)  # exactly nanochat's RustBPETokenizer.save
    return directory
