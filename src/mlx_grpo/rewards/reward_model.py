"""Reward models: Hugging Face `*ForSequenceClassification` checkpoints in MLX, and the reward they give.

Such a checkpoint is a decoder backbone that mlx-lm supports (its `model.*` tensors) plus a linear
`score` head [num_labels, hidden]; the score of a conversation is the head applied to the hidden state
of its last token (as transformers does). `convert --hf-path` writes the same layout in MLX form
(cast, optionally quantized), which `load_reward_model` reads as well as the original checkpoint.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_grpo.base.errors import UserError
from mlx_grpo.models.writing import mlx_dtype, staged_output, write_record
from mlx_grpo.rewards.builtin import completion_text, extract_answer

SCORE_HEAD = "score"
# Supported model types -> the mlx-lm module whose Model builds their backbone as `model` (inputs [n, L] -> final
# hidden states [n, L, D]); mistral is mlx-lm's llama.
BACKBONES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# Tokenizer and template files copied next to converted weights.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json", "generation_config.json")


def is_sequence_classifier(config: dict) -> bool:
    return any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or ())


class SequenceScorer(nn.Module):
    """The backbone plus the score head. inputs [n, L] right-padded, lengths [n] -> scores [n, num_labels]."""

    def __init__(self, backbone: nn.Module, hidden_size: int, num_labels: int):
        super().__init__()
        self.model = backbone
        self.score = nn.Linear(hidden_size, num_labels, bias=False)

    def __call__(self, inputs: mx.array, lengths: mx.array) -> mx.array:
        hidden = self.model(inputs)  # [n, L, D]; right padding leaves real positions unchanged (causal)
        last = mx.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1).squeeze(1)  # [n, D]
        return self.score(last).astype(mx.float32)  # [n, num_labels]


def _read(path: Path) -> tuple[dict, dict]:
    if not (path / "config.json").is_file():
        raise UserError(f"reward model {path} has no config.json")
    config = json.loads((path / "config.json").read_text())
    if not is_sequence_classifier(config):
        raise UserError(f"{path} is not a *ForSequenceClassification checkpoint (architectures: "
                        f"{config.get('architectures')}); a reward model needs a score head")
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise UserError(f"reward model {path} has no .safetensors weights")
    weights = {}
    for f in files:
        weights.update(mx.load(str(f)))
    return config, weights


def _build(config: dict, weights: dict, source: str) -> SequenceScorer:
    if config.get("model_type") not in BACKBONES:
        raise UserError(f"reward model type {config.get('model_type')!r} is not supported: use a "
                        f"{', '.join(BACKBONES)} *ForSequenceClassification checkpoint")
    arch = importlib.import_module(f"mlx_lm.models.{BACKBONES[config['model_type']]}")
    lm = arch.Model(arch.ModelArgs.from_dict(config))  # for its backbone and its sanitize(); its head is dropped
    labels = int(config.get("num_labels") or len(config.get("id2label") or {}) or 1)
    model = SequenceScorer(lm.model, config["hidden_size"], labels)
    if "quantization" in config:
        q = config["quantization"]
        nn.quantize(model.model, group_size=q["group_size"], bits=q["bits"])
    head = {k: v for k, v in weights.items() if k.startswith(SCORE_HEAD + ".")}
    if f"{SCORE_HEAD}.weight" not in head:
        raise UserError(f"{source}: no '{SCORE_HEAD}.weight' tensor: not a sequence-classification checkpoint")
    body = lm.sanitize({k: v for k, v in weights.items() if k not in head}) if hasattr(lm, "sanitize") else weights
    body = {k: v for k, v in body.items() if k.startswith("model.")}  # drop a causal-LM head some exports keep
    try:
        model.load_weights(list({**body, **head}.items()), strict=True)
    except ValueError as e:
        raise UserError(f"{source}: tensors do not match a {config['model_type']} reward model: {e}") from None
    mx.eval(model.parameters())
    return model


def _local(path_or_hub: str) -> Path:
    path = Path(path_or_hub).expanduser()
    if path.is_dir():
        return path
    if path_or_hub.count("/") == 1 and not path_or_hub.startswith((".", "/", "~")):
        from huggingface_hub import snapshot_download  # the user asked for a hub model

        try:
            return Path(snapshot_download(path_or_hub, allow_patterns=["*.json", "model*.safetensors", "*.model",
                                                                       "*.txt", "*.jinja"]))
        except Exception as e:
            raise UserError(f"reward model {path_or_hub!r} is not a directory here and could not be fetched from "
                            f"the Hugging Face hub ({type(e).__name__})") from None
    raise UserError(f"reward model {path_or_hub!r} not found: give a directory or a hub id like 'org/name'")


def load_reward_model(path_or_hub: str):
    """-> (SequenceScorer, mlx-lm TokenizerWrapper)."""
    from mlx_lm.utils import load_tokenizer

    path = _local(path_or_hub)
    config, weights = _read(path)
    model = _build(config, weights, str(path))
    model.pad_token_id = config.get("pad_token_id")  # where transformers reads the score: see score_ids
    return model, load_tokenizer(path)


def convert_reward_model(hf_path: str, output_dir: Path, *, dtype: str | None, quantize: bool, bits: int,
                         group_size: int, record: dict) -> None:
    """Write the checkpoint's backbone and score head as MLX weights (cast, optionally quantized)."""
    import shutil

    path = _local(hf_path)
    config, weights = _read(path)
    if dtype:
        target = mlx_dtype(dtype)
        weights = {k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    model = _build(config, weights, str(path))
    if quantize:
        nn.quantize(model.model, group_size=group_size, bits=bits)
        config = {**config, "quantization": {"group_size": group_size, "bits": bits}}
    with staged_output(output_dir) as tmp:
        tensors = dict(tree_flatten(model.parameters()))
        mx.save_safetensors(str(tmp / "model.safetensors"), tensors, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name in _TOKENIZER_FILES:
            if (path / name).is_file():
                shutil.copy2(path / name, tmp / name)
        write_record(tmp, record)


def render(tokenizer, prompt, completion: str) -> list[int]:
    """The conversation (prompt messages + the completion as the assistant turn) in the reward model's
    own chat template, as token ids; plain "prompt\\ncompletion" when it has no template."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    messages = messages + [{"role": "assistant", "content": completion}]
    if getattr(tokenizer, "chat_template", None) is not None:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode("\n".join(str(m["content"]) for m in messages)))


class RewardModelReward:
    """A reward function (TRL signature): the reward model's score of each conversation, clipped to
    [-clip, clip]; with answer_weight w > 0 mixed as (1 - w) * score + w * score of the <answer> text
    (-clip when there is none)."""

    def __init__(self, path_or_hub: str, clip: float, answer_weight: float, batch_size: int):
        self.model, self.tokenizer = load_reward_model(path_or_hub)
        self.clip, self.answer_weight, self.batch_size = clip, answer_weight, batch_size
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else 0  # right padding: never read (last real token is)

    def score_ids(self, rows: list[list[int]]) -> list[float]:
        """Raw scores (first label) of tokenized conversations, in batches of similar length. As in
        transformers, a row's score is read at its rightmost token that is not the config's pad id."""
        pad = self.model.pad_token_id
        ends = [max((i + 1 for i, t in enumerate(r) if t != pad), default=len(r)) if pad is not None else len(r)
                for r in rows]
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
        out = [0.0] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            width = max(len(rows[i]) for i in chunk)
            inputs = mx.array([rows[i] + [self.pad_id] * (width - len(rows[i])) for i in chunk], dtype=mx.int32)
            scores = self.model(inputs, mx.array([max(ends[i], 1) for i in chunk]))[:, 0].tolist()
            for i, value in zip(chunk, scores):
                out[i] = value
        return out

    def __call__(self, prompts, completions, completion_ids, **columns) -> list[float]:
        def clip(s: float) -> float:
            return min(max(s, -self.clip), self.clip)

        texts = [completion_text(c) for c in completions]
        scores = [clip(s) for s in self.score_ids([render(self.tokenizer, p, t) for p, t in zip(prompts, texts)])]
        if self.answer_weight > 0:  # a completion without an <answer> block gets the lowest answer score
            answers = [extract_answer(t) for t in texts]
            answer_scores = self.score_ids([render(self.tokenizer, p, a or "") for p, a in zip(prompts, answers)])
            w = self.answer_weight
            # Both scores clipped before mixing: a disliked answer (below -clip unclipped) must not mix
            # below a missing one, which gets exactly -clip.
            scores = [(1 - w) * s + w * (clip(a) if ans is not None else -self.clip)
                      for s, a, ans in zip(scores, answer_scores, answers)]
        return scores
