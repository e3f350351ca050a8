"""Policies that call tools, for the multi-turn tests: a scripted one and a tiny llama that writes calls.

`Scripted` is a model-shaped object for the decode loop: its KV cache stores the token ids themselves, so
each step it reads the row's whole history and writes what `script(prompt, completion)` says next (one
character per token with the byte tokenizer of conftest.py). `write_caller_model` builds a real llama whose
weights make it a bigram model that often calls the calculator in nanochat's syntax
(`<|python_start|>2+3<|python_end|>`, special tokens of its tokenizer), for runs through the trainer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from conftest import write_tokenizer

END = "<|im_end|>"
NANOCHAT_TOOL_TOKENS = ("<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>")
ASSISTANT = "<|im_start|>assistant\n"


class Scripted(nn.Module):
    """script(prompt_text, completion_text) -> {next text piece: logit}; unlisted tokens get -30 (the piece's
    first token is what counts). Rows decode through mlx-lm's BatchKVCache (rollout.generate_rollout)."""

    def __init__(self, tokenizer, script):
        super().__init__()
        self.layers = [nn.Identity()]  # one cache
        self._tok, self._script = tokenizer, script
        self._vocab = len(tokenizer.get_vocab())

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        c = cache[0]
        as_float = inputs.astype(mx.float32)[:, None, :, None]  # [B, 1, L, 1]
        history, _ = c.update_and_fetch(as_float, as_float)
        history = np.array(history[:, 0, :, 0]).astype(np.int64)
        left = np.array(c.left_padding).tolist()
        logits = np.full((inputs.shape[0], self._vocab), -30.0, dtype=np.float32)
        for b, row in enumerate(history):
            text = self._tok.decode(row[int(left[b]):].tolist())
            prompt, _, completion = text.rpartition(ASSISTANT)
            for piece, logit in self._script(prompt, completion).items():
                logits[b, self._tok.encode(piece, add_special_tokens=False)[0]] = logit
        out = mx.array(logits)[:, None, :]
        return mx.broadcast_to(out, (inputs.shape[0], inputs.shape[1], self._vocab))


def write_caller_model(path: Path, transitions: dict[str, dict[str, float]], hidden: int = 32) -> Path:
    """A tiny llama that is a bigram model: next-token probabilities given the last token are
    `transitions[last piece][next piece]` (a piece: a byte's char or a special token; any other token goes
    to transitions' first key). Its tokenizer has nanochat's tool tokens. The
    attention and MLP outputs are zero, so logits depend on the last token only."""
    from mlx_lm.models import llama
    from tokenizers import Tokenizer

    path.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tokenizer(path, NANOCHAT_TOOL_TOKENS)
    config = {"model_type": "llama", "hidden_size": hidden, "num_hidden_layers": 1, "intermediate_size": 2 * hidden,
              "num_attention_heads": 2, "num_key_value_heads": 1, "rms_norm_eps": 1e-6, "vocab_size": vocab_size,
              "rope_theta": 10000.0, "tie_word_embeddings": False, "max_position_embeddings": 2048,
              "eos_token_id": 2}
    model = llama.Model(llama.ModelArgs.from_dict(config))
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))

    def tid(piece: str) -> int:
        return tok.encode(piece, add_special_tokens=False).ids[0]

    states = {c: i + 1 for i, c in enumerate(transitions)}  # state 0: any other token
    assert len(states) < hidden
    embed = np.zeros((vocab_size, hidden), np.float32)
    embed[:, 0] = 1.0
    for c, i in states.items():
        embed[tid(c)] = 0.0
        embed[tid(c), i] = 1.0
    head = np.full((vocab_size, hidden), -30.0, np.float32)
    rows = {0: {next(iter(transitions)): 1.0}} | {i: transitions[c] for c, i in states.items()}
    for i, nxt in rows.items():
        for piece, p in nxt.items():
            head[tid(piece), i] = math.log(p)
    head /= math.sqrt(hidden)  # RMSNorm scales a one-hot vector by sqrt(hidden)
    params = dict(tree_flatten(model.parameters()))
    params["model.embed_tokens.weight"] = mx.array(embed)
    params["lm_head.weight"] = mx.array(head)
    for k in params:
        if k.endswith("o_proj.weight") or k.endswith("down_proj.weight"):
            params[k] = mx.zeros_like(params[k])
    mx.save_safetensors(str(path / "model.safetensors"), params)
    (path / "config.json").write_text(json.dumps(config))
    return path


# Calls the calculator (2+3, or 2+3+3...) or answers at once; after the tool's output, answers or calls again.
CALLER = {"\n": {"<|python_start|>": 0.8, "5": 0.2}, "<|python_start|>": {"2": 1.0}, "2": {"+": 1.0},
          "+": {"3": 1.0}, "3": {"<|python_end|>": 0.7, "+": 0.3}, "<|output_end|>": {"5": 0.6, "<|python_start|>": 0.4},
          "5": {END: 1.0}}
