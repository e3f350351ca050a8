"""GGUF -> MLX conversion: tiny llama models written the way llama.cpp's converter writes them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import gguf
import mlx_lm
from mlx_lm.models.llama import Model, ModelArgs

from mlx_grpo.base.errors import UserError  # noqa: E402
from mlx_grpo.models import gguf as conv  # noqa: E402
from mlx_grpo.models.gguf_tokenizer import build_tokenizer  # noqa: E402

N_HEADS, N_KV = 4, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}"
)
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "Ġa n", "Ġan d"]
TOKEN_IDS = [[1, 40, 60, 7, 200, 3, 99, 260, 12, 2, 150, 5]]

# HF (mlx_lm) name -> GGUF name, as llama.cpp's tensor map does it
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_BLOCK = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def _vocab() -> tuple[list[str], list[int]]:
    tokens = CONTROL + _bytes_to_unicode() + ["".join(m.split()) for m in MERGES]
    types = [3] * len(CONTROL) + [1] * (len(tokens) - len(CONTROL))
    return tokens, types


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.LlamaModel.permute, verbatim in numpy."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tiny_model(tied: bool) -> Model:
    mx.random.seed(0 if tied else 1)
    args = ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=N_HEADS, num_key_value_heads=N_KV, rms_norm_eps=1e-5,
        vocab_size=len(_vocab()[0]), rope_theta=10000.0, tie_word_embeddings=tied,
        max_position_embeddings=256,
    )
    model = Model(args)
    # non-trivial norms, so a swapped or dropped norm shows up in the logits
    norms = {n: 1 + 0.2 * mx.random.normal(p.shape) for n, p in tree_flatten(model.parameters()) if "norm" in n}
    model.load_weights(list(norms.items()), strict=False)
    mx.eval(model.parameters())
    return model


def _write_gguf(path: Path, model: Model, qtype=None, arch: str = "llama", **tok_overrides) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_block_count(2)
    writer.add_feed_forward_length(128)
    writer.add_head_count(N_HEADS)
    writer.add_head_count_kv(N_KV)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(64 // N_HEADS)
    tokens, types = _vocab()
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model(tok_overrides.get("model", "gpt2"))
    writer.add_tokenizer_pre(tok_overrides.get("pre", "smollm"))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(tok_overrides.get("add_bos", False))
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, w in tree_flatten(model.parameters()):
        writer_args = _gguf_tensor(name, np.array(w, dtype=np.float32), qtype)
        writer.add_tensor(*writer_args[:2], raw_dtype=writer_args[2])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_tensor(name: str, w: np.ndarray, qtype):
    stem, kind = name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        layer, sub = stem[len("model.layers."):].split(".", 1)
        gname = f"blk.{layer}.{_BLOCK[sub]}.{kind}"
    else:
        gname = f"{_GLOBAL[stem]}.{kind}"
    if _is_proj(name, "q_proj"):
        w = _llama_cpp_permute(w, N_HEADS)
    elif _is_proj(name, "k_proj"):
        w = _llama_cpp_permute(w, N_KV)
    if qtype is None or w.ndim == 1:  # llama.cpp keeps 1-D tensors (norms) in F32
        return gname, w, None
    return gname, gguf.quants.quantize(w, qtype), qtype


def _is_proj(name: str, proj: str) -> bool:
    return f".{proj}." in name


def _logits(model, ids=TOKEN_IDS) -> mx.array:
    return model(mx.array(ids)).astype(mx.float32)


@pytest.fixture(scope="module")
def f32_case(tmp_path_factory):
    d = tmp_path_factory.mktemp("f32")
    model = _tiny_model(tied=False)
    out = conv.convert_gguf(_write_gguf(d / "m.gguf", model), d / "out", dtype="float32")
    return model, out


@pytest.fixture(scope="module")
def q8_case(tmp_path_factory):
    d = tmp_path_factory.mktemp("q8")
    model = _tiny_model(tied=True)
    path = _write_gguf(d / "m.gguf", model, gguf.GGMLQuantizationType.Q8_0)
    return model, path, conv.convert_gguf(path, d / "out", dtype="float32")


def test_f32_logits_match_original(f32_case):
    model, out = f32_case
    loaded, _ = mlx_lm.load(str(out))
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["vocab_size"] == len(_vocab()[0])
    assert config["bos_token_id"] == 1 and config["eos_token_id"] == 2 and config["torch_dtype"] == "float32"
    assert mx.allclose(_logits(loaded), _logits(model), atol=1e-4).item()


def test_q8_0_logits_close_to_original(q8_case):
    model, _, out = q8_case
    loaded, _ = mlx_lm.load(str(out))
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    ref = _logits(model)
    err = mx.abs(_logits(loaded) - ref).max().item()
    assert err < 0.02 * mx.abs(ref).max().item(), err


def test_unpermute_inverts_llama_cpp_permute():
    w = np.random.default_rng(0).standard_normal((4 * 16, 8)).astype(np.float32)
    permuted = mx.array(_llama_cpp_permute(w, 4))
    assert np.array_equal(np.array(conv.permute_qk(mx.array(w), 4)), np.array(permuted))
    assert np.array_equal(np.array(conv.unpermute_qk(permuted, 4)), w)
    bias = np.arange(2 * 8, dtype=np.float32)  # q/k biases get the same row permutation
    assert np.array_equal(np.array(conv.unpermute_qk(mx.array(_llama_cpp_permute(bias, 2)), 2)), bias)


def test_without_unpermute_logits_differ(f32_case, tmp_path, monkeypatch):
    model, _ = f32_case
    monkeypatch.setattr(conv, "unpermute_qk", lambda w, n: w)
    out = conv.convert_gguf(_write_gguf(tmp_path / "m.gguf", model), tmp_path / "out", dtype="float32")
    naive, _ = mlx_lm.load(str(out))
    assert mx.abs(_logits(naive) - _logits(model)).max().item() > 1e-2


def test_tokenizer_round_trip_and_special_tokens(f32_case):
    _, out = f32_case
    _, tok = mlx_lm.load(str(out))
    text = "<|im_start|>user\nthe 2024 band and 7 in<|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == 1 and ids[-1] == 2  # control tokens are single ids
    assert tok.decode(ids) == text
    digits = tok.encode("2024")
    assert len(digits) == 4 and tok.decode(digits) == "2024"  # smollm pre-tokenizer: one digit each
    assert len(tok.encode(" the")) == 1  # merges apply
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE and config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert tok.decode(prompt) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_add_bos_token_prepends_bos_once(q8_case, tmp_path):
    model, _, _ = q8_case
    path = _write_gguf(tmp_path / "m.gguf", model, pre="llama-bpe", add_bos=True)
    out = conv.convert_gguf(path, tmp_path / "out", dtype="float32")
    _, tok = mlx_lm.load(str(out))
    ids = tok.encode("the 2024")
    assert ids[0] == 1 and ids.count(1) == 1
    assert tok.decode(ids[1:]) == "the 2024"


def test_quantize_writes_quantization_config(q8_case, tmp_path):
    model, path, _ = q8_case
    out = conv.convert_gguf(path, tmp_path / "out", dtype="float32", quantize=True, q_bits=8, q_group_size=32)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    loaded, _ = mlx_lm.load(str(out))
    ref = _logits(model)
    assert mx.abs(_logits(loaded) - ref).max().item() < 0.05 * mx.abs(ref).max().item()


def test_unsupported_architecture(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UserError, match="unsupported architecture 'gpt2'"):
        conv.convert_gguf(tmp_path / "g.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_file_and_existing_output(q8_case, tmp_path):
    with pytest.raises(UserError, match="not found"):
        conv.convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    (tmp_path / "out").mkdir()
    with pytest.raises(UserError, match="already exists"):
        conv.convert_gguf(q8_case[1], tmp_path / "out")
    with pytest.raises(UserError, match="dtype"):
        conv.convert_gguf(q8_case[1], tmp_path / "other", dtype="int8")


def test_interrupted_conversion_leaves_nothing(q8_case, tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(conv, "write_tokenizer_files", boom)
    with pytest.raises(RuntimeError, match="interrupted"):
        conv.convert_gguf(q8_case[1], tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_unsupported_tokenizers():
    tokens, types = _vocab()
    meta = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": mx.array(types)}
    with pytest.raises(UserError, match="unsupported tokenizer model 'llama'"):
        build_tokenizer({**meta, "tokenizer.ggml.model": "llama"})
    with pytest.raises(UserError, match="'qwen2'"):
        build_tokenizer({**meta, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2"})


def _llama_cpp_rope_factors(base, dims, factor, lo, hi, ctx):
    """llama.cpp's rope_freqs tensor for Llama-3.1 scaling (convert_hf_to_gguf, LlamaModel)."""
    out = []
    for i in range(0, dims, 2):
        wavelen = 2 * math.pi / (1.0 / base ** (i / dims))
        if wavelen < ctx / hi:
            out.append(1.0)
        elif wavelen > ctx / lo:
            out.append(factor)
        else:
            smooth = (ctx / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return mx.array(out, dtype=mx.float32)


def test_llama3_rope_freqs_become_rope_scaling():
    from mlx_lm.models.rope_utils import Llama3RoPE

    meta = {
        "general.architecture": "llama", "llama.attention.head_count": mx.array(32),
        "llama.embedding_length": mx.array(4096), "llama.feed_forward_length": mx.array(14336),
        "llama.block_count": mx.array(32), "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5),
        "llama.rope.freq_base": mx.array(500000.0), "llama.context_length": mx.array(131072),
    }
    tensors = {"token_embd.weight": mx.zeros((8, 4)), "rope_freqs.weight": _llama_cpp_rope_factors(500000.0, 128, 8.0, 1.0, 4.0, 8192)}
    scaling = conv.build_config(meta, tensors, Path("x.gguf"), "bfloat16")["rope_scaling"]
    ref = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    got = Llama3RoPE(128, 131072, base=500000.0, scaling_config=scaling)._freqs
    want = Llama3RoPE(128, 131072, base=500000.0, scaling_config=ref)._freqs
    assert mx.allclose(got, want, rtol=1e-4).item()
    with pytest.raises(UserError, match="RoPE scaling type"):
        conv.build_config(
            {**meta, "llama.rope.scaling.type": "weird", "llama.rope.scaling.factor": mx.array(2.0)},
            {"token_embd.weight": mx.zeros((8, 4))}, Path("x"), "float32",
        )
