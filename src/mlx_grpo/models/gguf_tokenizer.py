"""Hugging Face tokenizer files from GGUF `tokenizer.ggml.*` metadata.

Owns rebuilding a byte-level BPE fast tokenizer (tokenizer.json) with the `tokenizers` library
only, plus tokenizer_config.json and special_tokens_map.json, so that transformers' AutoTokenizer
(and therefore mlx_lm.load) opens the converted directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from mlx_grpo.base.errors import UserError

# llama.cpp token types (llama_token_type / gguf.TokenType)
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PRE = ("llama-bpe", "llama3", "smaug-bpe")
_DIGITS_PRE = ("smollm", "starcoder", "refact")  # llama.cpp: single digits, then the GPT-2 regex
_GPT2_PRE = (None, "default", "gpt2", "gpt-2")


def _meta(metadata: dict, key: str, default=None):
    value = metadata.get(key, default)
    return value.item() if isinstance(value, mx.array) and value.ndim == 0 else value


def build_tokenizer(metadata: dict) -> Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to llama.cpp's view of the GGUF vocabulary."""
    kind = _meta(metadata, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise UserError(
            f"unsupported tokenizer model {kind!r} in the GGUF file: only byte-level BPE ('gpt2') "
            "vocabularies can be converted"
        )
    tokens = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    pre = _meta(metadata, "tokenizer.ggml.pre")
    vocab = {tok: i for i, tok in reversed(list(enumerate(tokens)))}  # first id wins on duplicates
    model = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _LLAMA3_PRE)
    tok = Tokenizer(model)
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = _post_processor(metadata, tokens)
    _add_special_tokens(tok, metadata, tokens)
    return tok


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _DIGITS_PRE:  # SmolLM2's own tokenizer.json has exactly this
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _LLAMA3_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    raise UserError(f"unsupported GGUF tokenizer pre-tokenizer {pre!r} (tokenizer.ggml.pre)")


def _post_processor(metadata: dict, tokens: list[str]) -> processors.PostProcessor:
    """ByteLevel offsets, plus bos/eos insertion when the GGUF says llama.cpp adds them."""
    byte_level = processors.ByteLevel(trim_offsets=False)
    specials = _special_ids(metadata)
    bos = specials.get("bos") if _meta(metadata, "tokenizer.ggml.add_bos_token", False) else None
    eos = specials.get("eos") if _meta(metadata, "tokenizer.ggml.add_eos_token", False) else None
    if bos is None and eos is None:
        return byte_level
    added = [i for i in (bos, eos) if i is not None]
    pre = [tokens[bos]] if bos is not None else []
    post = [tokens[eos]] if eos is not None else []
    template = processors.TemplateProcessing(
        single=pre + ["$A"] + post,
        pair=pre + ["$A"] + post + [f"{t}:1" for t in pre] + ["$B:1"] + [f"{t}:1" for t in post],
        special_tokens=[(tokens[i], i) for i in dict.fromkeys(added)],
    )
    return processors.Sequence([byte_level, template])


def _add_special_tokens(tok: Tokenizer, metadata: dict, tokens: list[str]) -> None:
    """CONTROL tokens become special added tokens; USER_DEFINED ones plain added tokens."""
    types = metadata.get("tokenizer.ggml.token_type")
    types = types.tolist() if types is not None else []
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
    )


def _special_ids(metadata: dict) -> dict[str, int]:
    names = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "pad": "padding_token_id"}
    ids = {k: _meta(metadata, f"tokenizer.ggml.{v}") for k, v in names.items()}
    n = len(metadata["tokenizer.ggml.tokens"])
    return {k: int(v) for k, v in ids.items() if v is not None and 0 <= v < n}


def write_tokenizer_files(tok: Tokenizer, metadata: dict, out_dir: Path, config: dict) -> None:
    """Write tokenizer.json (from `build_tokenizer`), tokenizer_config.json and special_tokens_map.json."""
    tok.save(str(out_dir / "tokenizer.json"))
    tokens = metadata["tokenizer.ggml.tokens"]
    ids = _special_ids(metadata)
    ids.setdefault("pad", ids.get("eos"))  # generation needs some pad token; eos is the usual choice
    special = {f"{k}_token": tokens[v] for k, v in ids.items() if v is not None}
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": bool(_meta(metadata, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_meta(metadata, "tokenizer.ggml.add_eos_token", False)),
        "model_max_length": config.get("max_position_embeddings"),
        "clean_up_tokenization_spaces": False,
    }
    template = _meta(metadata, "tokenizer.chat_template")
    if template:
        tok_config["chat_template"] = template
    _write_json(out_dir / "tokenizer_config.json", tok_config)
    _write_json(out_dir / "special_tokens_map.json", special)


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
