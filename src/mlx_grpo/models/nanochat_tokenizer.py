"""nanochat's `tokenizer.pkl` -> Hugging Face tokenizer files, without running pickle code.

Owns three things: reading the pickled `tiktoken.Encoding` that nanochat saves (an unpickler that
admits only that one class and records its state, so tiktoken need not be installed and a hostile
file cannot run code); rebuilding it as an equivalent byte-level BPE `tokenizer.json`; and the
tokenizer_config.json / generation_config.json that give mlx-lm nanochat's chat rendering and its
stop tokens (`eos_token_ids` is what the converter puts into config.json).
"""

from __future__ import annotations

import io
import json
import pickle
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from mlx_grpo.base.errors import UserError

SPECIAL_TOKENS = (
    "<|bos|>",
    "<|user_start|>",
    "<|user_end|>",
    "<|assistant_start|>",
    "<|assistant_end|>",
    "<|python_start|>",
    "<|python_end|>",
    "<|output_start|>",
    "<|output_end|>",
)
BOS, EOS = "<|bos|>", "<|assistant_end|>"

# nanochat's render_conversation: a leading system message is merged into the first user message
# with a blank line, roles must then alternate user/assistant, everything starts with <|bos|>.
# Only plain-string contents are supported (nanochat's python tool parts are not chat input here).
CHAT_TEMPLATE = (
    "{%- set offset = 1 if messages and messages[0]['role'] == 'system' else 0 -%}"
    "{{- '<|bos|>' -}}"
    "{%- for message in messages[offset:] -%}"
    "{%- if message['role'] != ('user' if loop.index0 % 2 == 0 else 'assistant') -%}"
    "{{- raise_exception('nanochat conversations alternate user and assistant messages, "
    "after an optional first system message') -}}"
    "{%- endif -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- '<|user_start|>' -}}"
    "{%- if loop.first and offset == 1 -%}{{- messages[0]['content'] + '\\n\\n' -}}{%- endif -%}"
    "{{- message['content'] + '<|user_end|>' -}}"
    "{%- else -%}"
    "{{- '<|assistant_start|>' + message['content'] + '<|assistant_end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant_start|>' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class TiktokenState:
    """The constructor arguments of a `tiktoken.Encoding`, exactly as its `__getstate__` pickles them."""

    name: str
    pat_str: str
    mergeable_ranks: dict[bytes, int]
    special_tokens: dict[str, int]


class _EncodingPlaceholder:
    """Stands in for `tiktoken.core.Encoding` while unpickling: keeps the state, runs nothing."""

    def __setstate__(self, state: object) -> None:
        self.state = state


class _TiktokenUnpickler(pickle.Unpickler):
    """Resolves no global but tiktoken's Encoding class: every other import a pickle asks for
    (os.system, builtins.eval, ...) is how pickles run code, so it is refused."""

    def __init__(self, file: io.BufferedIOBase, path: Path) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> type:
        if (module, name) == ("tiktoken.core", "Encoding"):
            return _EncodingPlaceholder
        raise UserError(
            f"{self._path}: refusing to load the pickle: it asks for the global {module}.{name}, and a "
            "nanochat tokenizer.pkl holds only a tiktoken Encoding (the file may be malicious)"
        )

    def persistent_load(self, pid: object) -> object:
        raise UserError(f"{self._path}: refusing to load the pickle: it uses persistent ids")


def read_tiktoken_pickle(path: str | Path) -> TiktokenState:
    """The state of the `tiktoken.Encoding` pickled in `path`, read without executing pickle code."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            obj = _TiktokenUnpickler(f, path).load()
    except FileNotFoundError:
        raise UserError(f"{path}: no such tokenizer file") from None
    except UserError:
        raise
    except Exception as e:  # truncated or corrupt pickles raise all sorts of types
        raise UserError(f"{path}: not a readable pickle ({type(e).__name__}: {e})") from None
    if not isinstance(obj, _EncodingPlaceholder) or not hasattr(obj, "state"):
        raise UserError(f"{path}: the pickle does not hold a tiktoken Encoding")
    state = obj.state
    if isinstance(state, str):  # tiktoken pickles its registered encodings by name only
        raise UserError(
            f"{path}: the pickle names the registered tiktoken encoding {state!r} instead of holding "
            "its vocabulary; only self-contained (nanochat-trained) tokenizers can be converted"
        )
    return _validated(state, path)


def _validated(state: object, path: Path) -> TiktokenState:
    keys = {"name", "pat_str", "mergeable_ranks", "special_tokens"}
    if not isinstance(state, dict) or set(state) != keys:
        raise UserError(f"{path}: the tiktoken Encoding state must be a dict with keys {sorted(keys)}")
    name, pat_str, ranks, specials = (state[k] for k in ("name", "pat_str", "mergeable_ranks", "special_tokens"))
    # `type(...) is int` also rejects bool, which is an int subclass
    ok = (
        isinstance(name, str)
        and isinstance(pat_str, str)
        and isinstance(ranks, dict)
        and all(type(k) is bytes and k and type(v) is int and v >= 0 for k, v in ranks.items())
        and isinstance(specials, dict)
        and all(type(k) is str and k and type(v) is int and v >= 0 for k, v in specials.items())
    )
    if not ok:
        raise UserError(
            f"{path}: malformed tiktoken Encoding state: expected name and pat_str strings, "
            "mergeable_ranks bytes -> int and special_tokens str -> int"
        )
    ids = list(ranks.values()) + list(specials.values())
    if len(set(ids)) != len(ids):
        raise UserError(f"{path}: the tiktoken Encoding state gives two tokens the same id")
    if any(bytes([b]) not in ranks for b in range(256)):
        raise UserError(f"{path}: mergeable_ranks lacks some of the 256 single bytes (not byte-level BPE)")
    return TiktokenState(name, pat_str, dict(ranks), dict(specials))


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (what ByteLevel pre-tokenizes to)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _merge_pair(ranks: dict[bytes, int], token: bytes, rank: int) -> tuple[bytes, bytes] | None:
    """The pair `token` is merged from: byte-pair-merge its bytes with the ranks below its own, as
    tiktoken would, until two parts remain. None if the token is not reachable by merges."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best: tuple[int, int] | None = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < rank and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            return None
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return (parts[0], parts[1])


def _require_specials(state: TiktokenState) -> None:
    missing = [t for t in SPECIAL_TOKENS if t not in state.special_tokens]
    if missing:
        raise UserError(f"the tokenizer lacks nanochat's special tokens {missing} (not a nanochat tokenizer?)")


def eos_token_ids(state: TiktokenState) -> list[int]:
    """Ids that end a generation: nanochat stops at <|assistant_end|> and at <|bos|> (a new document)."""
    _require_specials(state)
    return [state.special_tokens[EOS], state.special_tokens[BOS]]


def build_hf_tokenizer(state: TiktokenState) -> Tokenizer:
    """A `tokenizers.Tokenizer` encoding exactly as `tiktoken.Encoding(**state).encode_ordinary`."""
    to_char = _byte_to_unicode()

    def text(token: bytes) -> str:
        return "".join(to_char[b] for b in token)

    vocab = {text(tok): i for tok, i in state.mergeable_ranks.items()}
    merges = []
    for tok, rank in sorted(state.mergeable_ranks.items(), key=lambda kv: kv[1]):
        pair = _merge_pair(state.mergeable_ranks, tok, rank) if len(tok) > 1 else None
        if pair is not None:
            merges.append((text(pair[0]), text(pair[1])))
    vocab.update(state.special_tokens)  # so the added tokens below keep nanochat's ids
    # ignore_merges: tiktoken takes a regex piece that is itself a token as one token, unmerged
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(state.pat_str), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in state.special_tokens])
    return tok


def write_hf_tokenizer(state: TiktokenState, out_dir: str | Path) -> None:
    """Write tokenizer.json, tokenizer_config.json (nanochat chat template), special_tokens_map.json
    and generation_config.json (stop tokens) into `out_dir`."""
    _require_specials(state)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    build_hf_tokenizer(state).save(str(out_dir / "tokenizer.json"))
    # pad with eos, as the GGUF converter does: generation needs a pad token and nanochat has none
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS}
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "add_bos_token": False,  # the chat template writes <|bos|> itself
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(out_dir / "special_tokens_map.json", special)
    _write_json(
        out_dir / "generation_config.json",
        {"bos_token_id": state.special_tokens[BOS], "eos_token_id": eos_token_ids(state)},
    )


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
