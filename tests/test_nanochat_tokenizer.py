"""nanochat tokenizer.pkl: safe unpickling, HF conversion equal to tiktoken, mlx-lm chat and streaming."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import tiktoken
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer
from mlx_lm.utils import load_config, load_tokenizer

from mlx_grpo.base.errors import UserError
from mlx_grpo.models.nanochat_tokenizer import (
    SPECIAL_TOKENS,
    TiktokenState,
    eos_token_ids,
    read_tiktoken_pickle,
    write_hf_tokenizer,
)
from nanochat_fixture import CORPUS, SPLIT_PATTERN, make_encoding


@pytest.fixture(scope="module")
def enc() -> tiktoken.Encoding:
    return make_encoding()


@pytest.fixture(scope="module")
def pkl(enc, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("nanochat") / "tokenizer.pkl"
    with open(path, "wb") as f:
        pickle.dump(enc, f)  # exactly nanochat's RustBPETokenizer.save
    return path


@pytest.fixture(scope="module")
def hf_dir(pkl, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf")
    write_hf_tokenizer(read_tiktoken_pickle(pkl), out)
    return out


def test_reads_exact_state(enc, pkl):
    state = read_tiktoken_pickle(pkl)
    assert state == TiktokenState("rustbpe", SPLIT_PATTERN, enc._mergeable_ranks, enc._special_tokens)
    assert len(state.mergeable_ranks) > 300  # the training really merged


def test_reads_every_bytes_native_protocol(enc, tmp_path):
    # protocols 3+ (Python 3's defaults are 4 and 5) store bytes natively, so need no other global
    for protocol in range(3, pickle.HIGHEST_PROTOCOL + 1):
        path = tmp_path / f"p{protocol}.pkl"
        path.write_bytes(pickle.dumps(enc, protocol=protocol))
        assert read_tiktoken_pickle(path).mergeable_ranks == enc._mergeable_ranks


class _Exploit:
    def __init__(self, func, arg):
        self.func, self.arg = func, arg

    def __reduce__(self):
        return (self.func, (self.arg,))


def _malicious(tmp_path: Path) -> list[tuple[object, str]]:
    marker = tmp_path / "pwned"
    touch = _Exploit(os.system, f"touch {marker}")
    return [
        (touch, "system"),
        (_Exploit(eval, f"open({str(marker)!r}, 'w')"), "builtins.eval"),
        # the exploit hidden inside an otherwise genuine Encoding state
        (_Wrapped({"name": "x", "pat_str": "x", "mergeable_ranks": {}, "special_tokens": touch}), "system"),
        (_Exploit(Path, str(marker)), "pathlib"),
    ]


class _Wrapped:
    """Pickles as tiktoken.core.Encoding with an arbitrary state."""

    def __init__(self, state):
        self.state = state

    def __reduce__(self):
        return (tiktoken.core.Encoding, (), self.state)  # REDUCE + BUILD on the real class's name


def test_refuses_malicious_pickles(tmp_path):
    for i, (payload, refused) in enumerate(_malicious(tmp_path)):
        path = tmp_path / f"evil{i}.pkl"
        path.write_bytes(pickle.dumps(payload))
        with pytest.raises(UserError, match="refusing") as err:
            read_tiktoken_pickle(path)
        assert str(path) in str(err.value) and refused in str(err.value)
    assert not (tmp_path / "pwned").exists()


def test_refuses_bad_states(enc, tmp_path):
    good = {"name": "x", "pat_str": "x", "mergeable_ranks": enc._mergeable_ranks, "special_tokens": {"<|bos|>": 999}}
    cases = [
        {**good, "mergeable_ranks": {"a": 1}},
        {**good, "special_tokens": {"<|bos|>": "1"}},
        {**good, "special_tokens": {"<|bos|>": 0}},  # collides with byte 0
        {**good, "mergeable_ranks": {b"ab": 0}},  # not byte-level
        {"name": "x"},
        "cl100k_base",
    ]
    for i, state in enumerate(cases):
        path = tmp_path / f"bad{i}.pkl"
        path.write_bytes(pickle.dumps(_Wrapped(state)))
        with pytest.raises(UserError, match=str(path)):
            read_tiktoken_pickle(path)
    (tmp_path / "trunc.pkl").write_bytes(pickle.dumps(enc)[:100])
    with pytest.raises(UserError, match="not a readable pickle"):
        read_tiktoken_pickle(tmp_path / "trunc.pkl")


TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "They're here; we'VE seen it, I'll go, she'd SAY 'quoted'",
    "12 345 6789 2024-11-22, 3.14159 and 1000000!",
    "   leading spaces and trailing   ",
    "tabs\t\tand\r\nwindows lines\n\n\nand   \n  mixed",
    "def f(x):\n    return x * 2  # the answer\n",
    "café naïve résumé — “quotes” … ",
    "你好世界，你好！こんにちは",
    "emoji 🙂🎉 👍🏽 and ZWJ 👨‍👩‍👧",
    "unseen words zyxwv QQQ ~~~ @@@ ###",
    "\u00a0non-breaking\u2009thin\u3000ideographic spaces",
    "",
]


def test_hf_encodes_like_tiktoken(enc, hf_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    for text in TEXTS + [CORPUS]:
        ids = enc.encode_ordinary(text)
        assert tok.encode(text, add_special_tokens=False).ids == ids, text
        assert tok.decode(ids, skip_special_tokens=False) == text
    # the specials keep nanochat's ids and are single tokens inside text
    for name in SPECIAL_TOKENS:
        assert tok.token_to_id(name) == enc._special_tokens[name]
    text = "<|bos|><|user_start|>hi<|user_end|>"
    assert tok.encode(text, add_special_tokens=False).ids == enc.encode(text, allowed_special="all")


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_mlx_lm_chat_template_stop_tokens_and_streaming(enc, pkl, hf_dir):
    state = read_tiktoken_pickle(pkl)
    special = enc._special_tokens
    assert eos_token_ids(state) == [special["<|assistant_end|>"], special["<|bos|>"]]
    # mlx_lm.load's path: config.json's eos_token_id (generation_config.json's wins) -> load_tokenizer
    (hf_dir / "config.json").write_text(json.dumps({"model_type": "nanochat", "eos_token_id": eos_token_ids(state)}))
    assert load_config(hf_dir)["eos_token_id"] == eos_token_ids(state)
    (hf_dir / "config.json").write_text(json.dumps({"model_type": "nanochat"}))
    wrapper = load_tokenizer(hf_dir, eos_token_ids=load_config(hf_dir)["eos_token_id"])
    assert {special["<|assistant_end|>"], special["<|bos|>"]} <= set(wrapper.eos_token_ids)

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12+30?"}]
    text = wrapper.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|><|user_start|>Be brief.\n\nWhat is 12+30?<|user_end|><|assistant_start|>"
    # nanochat's render_for_completion: the system text is merged into the user turn with "\n\n"
    expected = [special["<|bos|>"], special["<|user_start|>"]]
    expected += enc.encode_ordinary("Be brief.\n\nWhat is 12+30?")
    expected += [special["<|user_end|>"], special["<|assistant_start|>"]]
    assert list(wrapper.encode(text, add_special_tokens=False)) == expected

    turns = messages[1:] + [{"role": "assistant", "content": "42"}, {"role": "user", "content": "ok"}]
    assert wrapper.apply_chat_template(turns, tokenize=False) == (
        "<|bos|><|user_start|>What is 12+30?<|user_end|><|assistant_start|>42<|assistant_end|>"
        "<|user_start|>ok<|user_end|>"
    )
    with pytest.raises(Exception, match="alternate"):
        wrapper.apply_chat_template([{"role": "assistant", "content": "x"}], tokenize=False)

    reply = "Sure: 你好 🙂🎉 café, 42! 漢字 😀"
    ids = enc.encode_ordinary(reply)
    assert not all(_is_utf8(enc.decode_single_token_bytes(i)) for i in ids)  # some tokens split characters
    detok = wrapper.detokenizer
    assert isinstance(detok, BPEStreamingDetokenizer)  # byte-aware, picked from the ByteLevel decoder
    detok.reset()
    for i in ids:
        detok.add_token(i)
        assert "\ufffd" not in detok.last_segment
    detok.finalize()
    assert detok.text == reply
