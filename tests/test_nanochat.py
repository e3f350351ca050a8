"""nanochat checkpoints: convert (latest step, dtype, errors), logits equal nanochat's formulas, chat
rendering and stop tokens, hostile or newer-design files refused, and the converted model in
generate, chat, eval and train (tokenizer files carried into checkpoints)."""

from __future__ import annotations

import io
import json
import os
import pickle
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from mlx_grpo.base.errors import UserError
from mlx_grpo.commands import train as run_mod
from mlx_grpo.commands.cli import main
from mlx_grpo.commands.convert import run_convert
from mlx_grpo.commands.evaluate import run_eval
from mlx_grpo.commands.inference import run_chat
from mlx_grpo.config import build_config, parse_set
from mlx_grpo.rollout.decode import encode_chat_prompt, generate_rollout
from mlx_grpo.rollout.rollout_records import SamplingParams
from mlx_grpo.training.policy import logprob_pass
from nanochat_fixture import CONFIG, make_encoding, random_state_dict, write_checkpoint

FIXTURES = Path(__file__).parent / "fixtures"
VOCAB_ROWS = 448  # embedding rows past the vocabulary are padding: the converter crops them, as nanochat its logits


@pytest.fixture(scope="module")
def encoding():
    return make_encoding(n_merges=60)


@pytest.fixture(scope="module")
def config(encoding):
    return {**CONFIG, "vocab_size": encoding.n_vocab}


@pytest.fixture(scope="module")
def state(config):
    return random_state_dict(config, VOCAB_ROWS)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, encoding, config, state) -> Path:
    """Two steps; the latest (10) holds `state`, the older one different weights."""
    directory = tmp_path_factory.mktemp("nanochat") / "d2"
    write_checkpoint(directory, random_state_dict(config, VOCAB_ROWS, seed=1), config, 5, encoding)
    return write_checkpoint(directory, state, config, 10)


@pytest.fixture(scope="module")
def converted(checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mlx") / "nanochat-d2"
    assert main(["convert", "--nanochat", str(checkpoint), "--output-dir", str(out)]) == 0
    return out


# F.rms_norm(x, (n,)) with eps=None adds float32's machine epsilon; mlx-lm's nanochat model adds 1e-5.
NANOCHAT_EPS, MLX_LM_EPS = float(np.finfo(np.float32).eps), 1e-5


def _rms_norm(x, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def _rotary(x, head_dim):
    # nanochat's apply_rotary_emb: halves (not interleaved pairs), y1 = x1 cos + x2 sin, y2 = -x1 sin + x2 cos
    t = np.arange(x.shape[1])
    inv_freq = 1.0 / (10000 ** (np.arange(0, head_dim, 2) / head_dim))
    freqs = np.outer(t, inv_freq)[None, :, None, :]  # [1, T, 1, D/2]
    cos, sin = np.cos(freqs), np.sin(freqs)
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2:]
    return np.concatenate([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], axis=-1)


def nanochat_logits(state: dict, config: dict, idx: list[int], eps: float = NANOCHAT_EPS) -> np.ndarray:
    """nanochat GPT.forward (original design) in float64 numpy, written from its formulas."""
    def norm(x):
        return _rms_norm(x, eps)

    w = {k: v.astype(np.float64) for k, v in state.items()}
    H, KV, d = config["n_head"], config["n_kv_head"], config["n_embd"]
    D, T = d // H, len(idx)
    x = norm(w["transformer.wte.weight"][idx][None])  # [1, T, d]
    causal = np.tril(np.ones((T, T), dtype=bool))
    for i in range(config["n_layer"]):
        p = f"transformer.h.{i}"
        h = norm(x)
        q = (h @ w[f"{p}.attn.c_q.weight"].T).reshape(1, T, H, D)
        k = (h @ w[f"{p}.attn.c_k.weight"].T).reshape(1, T, KV, D)
        v = (h @ w[f"{p}.attn.c_v.weight"].T).reshape(1, T, KV, D)
        q, k = norm(_rotary(q, D)), norm(_rotary(k, D))
        q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))  # [1, heads, T, D]
        k, v = np.repeat(k, H // KV, axis=1), np.repeat(v, H // KV, axis=1)
        scores = np.where(causal, q @ k.transpose(0, 1, 3, 2) / np.sqrt(D), -np.inf)
        att = np.exp(scores - scores.max(-1, keepdims=True))
        y = (att / att.sum(-1, keepdims=True)) @ v  # [1, H, T, D]
        x = x + y.transpose(0, 2, 1, 3).reshape(1, T, d) @ w[f"{p}.attn.c_proj.weight"].T
        m = np.maximum(norm(x) @ w[f"{p}.mlp.c_fc.weight"].T, 0) ** 2
        x = x + m @ w[f"{p}.mlp.c_proj.weight"].T
    logits = norm(x) @ w["lm_head.weight"].T
    return 15 * np.tanh(logits / 15)  # [1, T, V]


def _bf16(array: np.ndarray) -> np.ndarray:
    """What the checkpoint holds for nanochat's bfloat16 embedding."""
    return np.array(mx.array(array).astype(mx.bfloat16).astype(mx.float32))


def test_logits_equal_nanochat_reference(converted, state, config, encoding):
    model, tokenizer = load(str(converted))
    ids = [encoding._special_tokens["<|bos|>"]] + encoding.encode_ordinary("The quick brown fox, 12 345!")
    got = np.array(model(mx.array([ids])).astype(mx.float32))
    stored = {**state, "transformer.wte.weight": _bf16(state["transformer.wte.weight"])}
    V = config["vocab_size"]
    want = nanochat_logits(stored, config, ids)[..., :V]
    assert np.abs(want).max() > 12  # the softcap's non-linear range is exercised
    # nanochat's own epsilon: the only difference left is mlx-lm's larger one (a 5e-6 relative change in
    # each norm, up to ~5e-4 on these logits); with mlx-lm's, float32 rounding (pre-cap logits reach ~60)
    np.testing.assert_allclose(got, want, atol=1e-3, rtol=0)
    np.testing.assert_allclose(got, nanochat_logits(stored, config, ids, MLX_LM_EPS)[..., :V], atol=1e-4, rtol=0)
    # every weight but the bf16 embedding was float32 in the checkpoint: kept exactly
    assert model.transformer.h[0].attn.c_q.weight.dtype == mx.float32
    # nanochat names, so the check is direct: the mlx-lm model holds the latest step's tensors
    np.testing.assert_array_equal(np.array(model.lm_head.weight), state["lm_head.weight"][:V])


def test_converted_directory_and_latest_step(converted, encoding, config):
    cfg = json.loads((converted / "config.json").read_text())
    special = encoding._special_tokens
    assert cfg["model_type"] == "nanochat" and cfg["vocab_size"] == config["vocab_size"] < VOCAB_ROWS
    assert cfg["num_key_value_heads"] == 2 and cfg["intermediate_size"] == 4 * CONFIG["n_embd"]
    assert cfg["eos_token_id"] == [special["<|assistant_end|>"], special["<|bos|>"]]
    options = json.loads((converted / "mlx_grpo_convert.json").read_text())
    assert options["step"] == 10 and options["nanochat"] and options["dtype"] == "float32"  # as used
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "model.safetensors"):
        assert (converted / name).is_file(), name


def test_step_option_and_quantized_bf16(checkpoint, config, tmp_path):
    out = run_convert(nanochat=str(checkpoint), output_dir=str(tmp_path / "s5"), step=5, dtype="bfloat16")
    model, _ = load(str(out))
    older = random_state_dict(config, VOCAB_ROWS, seed=1)["lm_head.weight"]
    np.testing.assert_array_equal(np.array(model.lm_head.weight.astype(mx.float32)),
                                  _bf16(older[: config["vocab_size"]]))
    with pytest.raises(UserError, match=r"--step 7; steps present: 5, 10"):
        run_convert(nanochat=str(checkpoint), output_dir=str(tmp_path / "s7"), step=7)
    quantized = run_convert(nanochat=str(checkpoint), output_dir=str(tmp_path / "q"), quantize=True, bits=8,
                            group_size=32)
    assert json.loads((quantized / "config.json").read_text())["quantization"]["bits"] == 8
    assert load(str(quantized))[0](mx.array([[1, 2, 3]])).shape == (1, 3, config["vocab_size"])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logprobs_equal_training_pass(converted, temperature):
    """Prompts of different lengths decode left-padded on mlx-lm's cache; the training pass packs them
    right-padded in chunks: both must give the sampled tokens the same log-probs (softcap included)."""
    model, tokenizer = load(str(converted))
    prompts = [encode_chat_prompt(tokenizer, text, "", "", 64)[0] for text in ("hi", "The quick brown fox 12 345")]
    params = SamplingParams(max_new_tokens=10, temperature=temperature, ignore_eos=True)
    r = generate_rollout(model, tokenizer, prompts, 3, params, mx.random.key(3))
    mask = np.array(r.mask)
    pad = tokenizer.pad_token_id
    recomputed = np.array(logprob_pass(model, r, temperature, micro_batch=4, pad_id=pad, max_tokens=64))
    np.testing.assert_allclose(recomputed * mask, np.array(r.sampler_logprobs) * mask, atol=1e-4, rtol=0)
    assert mask.sum() == 60 and (np.array(r.sampler_logprobs)[mask > 0] < 0).all()


def test_chat_rendering_and_stop_tokens(converted, encoding):
    _, tokenizer = load(str(converted))
    special = encoding._special_tokens
    assert set(tokenizer.eos_token_ids) == {special["<|assistant_end|>"], special["<|bos|>"]}
    ids, _ = encode_chat_prompt(tokenizer, "What is 12+30?", "Be brief.", "", 512)
    assert ids == [special["<|bos|>"], special["<|user_start|>"],
                   *encoding.encode_ordinary("Be brief.\n\nWhat is 12+30?"),
                   special["<|user_end|>"], special["<|assistant_start|>"]]


def _stop_model(checkpoint_dir: Path, config, encoding, stop: str, out: Path) -> Path:
    """A model that greedily says `stop` first: zero block outputs leave h = norm(norm(wte[t])),
    positive embeddings and an all-ones lm_head row for `stop` make its logit the largest."""
    state = random_state_dict(config, VOCAB_ROWS, seed=2)
    state["transformer.wte.weight"] = np.abs(state["transformer.wte.weight"])
    for name in state:
        if name.endswith("c_proj.weight"):
            state[name][:] = 0
    state["lm_head.weight"] *= 0.01
    state["lm_head.weight"][encoding._special_tokens[stop]] = 1.0
    write_checkpoint(checkpoint_dir, state, config, 1, encoding)
    return run_convert(nanochat=str(checkpoint_dir), output_dir=str(out))


@pytest.mark.parametrize("stop", ["<|assistant_end|>", "<|bos|>"])
def test_generation_stops_at_nanochat_stop_tokens(tmp_path, config, encoding, stop, capsys):
    out = _stop_model(tmp_path / "ckpt", config, encoding, stop, tmp_path / "mlx")
    model, tokenizer = load(str(out))
    prompt, _ = encode_chat_prompt(tokenizer, "hi", "", "", 64)
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    rollout = generate_rollout(model, tokenizer, [prompt], 2, params, mx.random.key(0))
    assert rollout.texts == ["", ""]
    assert rollout.mask.sum(axis=1).tolist() == [1, 1]  # the stop token itself is the one completion token
    assert not rollout.truncated.any()
    assert main(["generate", "--model", str(out), "--prompt", "hi", "--max-tokens", "8"]) == 0
    assert "<|" not in capsys.readouterr().out


def test_generate_chat_eval_train_on_converted(converted, tmp_path, capsys):
    assert main(["generate", "--model", str(converted), "--prompt", "Hello", "--max-tokens", "6",
                 "--stream"]) == 0
    chat_cfg = build_config("chat", overrides=parse_set([f"model_name={converted}", "max_new_tokens=4"]))
    history = run_chat(chat_cfg, lines=["first", "second"], out=io.StringIO())
    assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]
    eval_cfg = build_config("eval", overrides=parse_set([f"model_name={converted}", "eval_subset_size=2",
                                                         "eval_max_new_tokens=4",
                                                         f"eval_dataset_path={FIXTURES / 'gsm8k_tiny.jsonl'}"]))
    result = run_eval(eval_cfg, output=str(tmp_path / "eval.jsonl"))
    assert len(result.records) == 2

    train_cfg = build_config("train", overrides=parse_set([
        f"model_name={converted}", f"output_dir={tmp_path}", f"dataset_path={FIXTURES / 'gsm8k_tiny.jsonl'}",
        "batch_size=1", "num_generations=4", "max_new_tokens=6", "max_train_samples=1", "learning_rate=1e-3",
        "warmup_ratio=0", f"reward_funcs={FIXTURES / 'toy_rewards.py'}:share_of_even_ids",
        "micro_batch_size=2", "kl_coeff=0.04"]))
    run = run_mod.train(train_cfg)
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert np.isfinite(row["loss"]) and row["grad_norm"] > 0
    ckpt = run / "checkpoint-1"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (ckpt / name).read_bytes() == (converted / name).read_bytes(), name
    model, tokenizer = load(str(ckpt))
    assert model.model_type == "nanochat"
    assert set(tokenizer.eos_token_ids) == set(json.loads((converted / "config.json").read_text())["eos_token_id"])
    trained = mx.load(str(ckpt / "model.safetensors"))
    original = mx.load(str(converted / "model.safetensors"))
    assert not np.allclose(np.array(trained["lm_head.weight"]), np.array(original["lm_head.weight"]))


def test_malicious_tokenizer_is_refused(tmp_path, config, state, capsys):
    directory = write_checkpoint(tmp_path / "evil", state, config, 1)
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (directory / "tokenizer.pkl").write_bytes(pickle.dumps(Exploit()))
    assert main(["convert", "--nanochat", str(directory), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "refusing to load the pickle" in err and "system" in err and "Traceback" not in err
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("variant", ["value_embeds", "lambdas", "window_pattern"])
def test_newer_nanochat_design_is_refused(tmp_path, config, state, encoding, variant):
    newer, meta = dict(state), {}
    if variant == "value_embeds":
        newer["value_embeds.1.weight"] = np.zeros((VOCAB_ROWS, 32), np.float32)
        newer["transformer.h.1.attn.ve_gate.weight"] = np.zeros((2, 32), np.float32)
    elif variant == "lambdas":
        newer.update(resid_lambdas=np.ones(2, np.float32), x0_lambdas=np.zeros(2, np.float32),
                     smear_lambda=np.zeros(1, np.float32), backout_lambda=np.ones(1, np.float32))
    directory = tmp_path / "new"
    cfg = {**config, "window_pattern": "SSSL"} if variant == "window_pattern" else config
    write_checkpoint(directory, newer, cfg, 3, encoding, meta)
    with pytest.raises(UserError, match="unsupported nanochat version") as err:
        run_convert(nanochat=str(directory), output_dir=str(tmp_path / "out"))
    assert {"value_embeds": "value_embeds.1.weight", "lambdas": "backout_lambda",
            "window_pattern": "window_pattern"}[variant] in str(err.value)
    assert not (tmp_path / "out").exists()


def test_bad_inputs_are_clear_errors(tmp_path, config, state, encoding, checkpoint, monkeypatch):
    cases = []
    empty = tmp_path / "empty"
    empty.mkdir()
    cases.append((empty, "no model_<step>.pt"))
    no_tok = write_checkpoint(tmp_path / "notok", state, config, 2)
    cases.append((no_tok, "no tokenizer.pkl"))
    no_meta = write_checkpoint(tmp_path / "nometa", state, config, 2, encoding)
    (no_meta / "meta_000002.json").unlink()
    cases.append((no_meta, "has no meta_000002.json"))
    wrong = write_checkpoint(tmp_path / "wrong", state, {**config, "n_layer": 3}, 2, encoding)
    cases.append((wrong, "has 2 layers, meta's model_config says n_layer=3"))
    odd = write_checkpoint(tmp_path / "odd", state, {**config, "n_head": 64}, 2, encoding)  # head dim 1
    cases.append((odd, "must be even"))
    other_tok = write_checkpoint(tmp_path / "othertok", state, config, 2, make_encoding(n_merges=20))
    cases.append((other_tok, "a tokenizer from another run"))
    ambiguous = write_checkpoint(tmp_path / "ambiguous", state, config, 2, encoding)
    (ambiguous / "model_2.pt").write_bytes((ambiguous / "model_000002.pt").read_bytes())
    cases.append((ambiguous, "are both step 2"))
    corrupt = write_checkpoint(tmp_path / "corrupt", state, config, 2, encoding)
    (corrupt / "model_000002.pt").write_bytes(b"not a zip")
    cases.append((corrupt, "could not read the checkpoint"))
    cases.append((tmp_path / "absent", "not found"))
    for i, (directory, message) in enumerate(cases):
        with pytest.raises(UserError, match=message):
            run_convert(nanochat=str(directory), output_dir=str(tmp_path / f"out{i}"))
        assert not (tmp_path / f"out{i}").exists()
    with pytest.raises(UserError, match="exactly one of"):
        run_convert(nanochat=str(checkpoint), gguf="x.gguf", output_dir=str(tmp_path / "o"))
    with pytest.raises(UserError, match="--step applies to --nanochat only"):
        run_convert(gguf="x.gguf", step=3, output_dir=str(tmp_path / "o"))
    import torch

    marker = tmp_path / "pwned-pt"

    class Exploit:  # unpickling it would create the marker: torch's weights_only loader must refuse first
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = write_checkpoint(tmp_path / "evilpt", state, config, 2, encoding)
    torch.save({"x": Exploit()}, evil / "model_000002.pt")
    fp8 = write_checkpoint(tmp_path / "fp8", state, config, 2, encoding)
    torch.save({"lm_head.weight": torch.zeros(2, 2, dtype=torch.float8_e4m3fn)}, fp8 / "model_000002.pt")
    twice = write_checkpoint(tmp_path / "twice", state, config, 2, encoding)
    torch.save({"_orig_mod.lm_head.weight": torch.zeros(2), "lm_head.weight": torch.zeros(2)},
               twice / "model_000002.pt")
    for directory, message in [(evil, "refusing to load"), (fp8, "float8_e4m3fn; expected float16"),
                               (twice, "appears twice")]:
        with pytest.raises(UserError, match=message) as err:
            run_convert(nanochat=str(directory), output_dir=str(tmp_path / "o2"))
        assert "weights_only=False" not in str(err.value)
    assert not marker.exists()
    # no PyTorch: one line saying which extra to install
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(UserError, match=r"needs PyTorch: pip install 'mlx-grpo\[nanochat\]'"):
        run_convert(nanochat=str(checkpoint), output_dir=str(tmp_path / "notorch"))


def test_tools_speak_nanochats_python_tokens(converted, tmp_path):
    """tools = calculator on a nanochat model: its python/output special tokens carry the calls and results,
    and a training run with them goes through."""
    from mlx_grpo.rollout.multiturn import multiturn_for
    from mlx_grpo.tools.calls import NanochatFormat
    from mlx_grpo.tools.environments import StepResult, observation_text

    cfg = build_config("train", overrides=parse_set([
        f"model_name={converted}", f"output_dir={tmp_path}", f"dataset_path={FIXTURES / 'gsm8k_tiny.jsonl'}",
        "batch_size=1", "num_generations=4", "max_new_tokens=8", "max_train_samples=1", "tools=[\"calculator\"]",
        "reward_funcs=[\"hash_answer\"]", "micro_batch_size=2", "system_prompt=", "prefill="]))
    model, tok = load(str(converted))
    multiturn = multiturn_for(cfg, tok, model.model_type)
    assert isinstance(multiturn.fmt, NanochatFormat)
    fed = tok.encode(observation_text(multiturn.fmt, StepResult(observation="5", origin="tool")),
                     add_special_tokens=False)
    vocab = tok.get_vocab()
    assert fed[0] == vocab["<|output_start|>"] and fed[-1] == vocab["<|output_end|>"]
    assert multiturn.fmt.find_call("x<|python_start|>1,000*3<|python_end|>").arguments == {"expression": "1000*3"}
    run = run_mod.train(cfg)
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert "tool_call_rate" in record and np.isfinite(record["loss"])
