"""Rollouts on a tiny random model: sampler log-probs equal a padded full forward, keys make rollouts
reproducible, EOS / stop strings cut and mask, the shared prefilled cache matches mlx-lm's own greedy
decode, and chat prompts keep their tail when cut."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map_with_path
from mlx_lm import load
from mlx_lm.generate import generate_step

from mlx_grpo.models.forward import completion_logprobs, pack
from mlx_grpo.rollout.decode import encode_chat_prompt, generate_rollout
from mlx_grpo.rollout.rollout_records import Rollout, SamplingParams
from mlx_grpo.rollout.sampler import finish_rollout
from mlx_grpo.training.policy import logprob_pass

EOS = 2  # <|im_end|> in the conftest tokenizer
PAD = 0  # <|endoftext|>


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    model, tok = load(str(tiny_model_dir))
    assert sorted(tok.eos_token_ids) == [EOS] and tok.pad_token_id == PAD
    return model, tok


def _prompts():
    """Two prompts of different lengths (left padding differs in the batched prefill). Fixed ids, not
    encoded text: the conftest tokenizer's byte -> id map is reshuffled in every session (tokenizers'
    ByteLevel.alphabet() order is not stable), so only fixed ids give the model a fixed input."""
    return [[17, 90], [120, 45, 203, 8, 77, 150, 33, 64, 99, 12, 250]]


def _np(x):
    return np.array(x.astype(mx.float32).tolist(), dtype=np.float64)


class Biased:
    """The tiny model with a constant added to its logits (to make given tokens likely)."""

    def __init__(self, inner, bias: dict[int, float], vocab: int):
        self.inner = inner
        self.layers = inner.layers
        b = np.zeros(vocab, np.float32)
        for token, value in bias.items():
            b[token] = value
        self.bias = mx.array(b)

    def __call__(self, x, cache=None):
        return self.inner(x, cache=cache) + self.bias


def _check_structure(r: Rollout, n: int):
    """Mask is a prefix of ones ending at the first EOS; after it, pad ids and zero log-probs;
    truncated iff the completion has no EOS (and then it fills every step)."""
    ids, mask, lps = r.completion_ids.tolist(), _np(r.mask), _np(r.sampler_logprobs)
    assert r.completion_ids.dtype == mx.int32 and r.mask.dtype == mx.float32
    assert len(ids) == n and len(r.texts) == n and r.truncated.shape == (n,)
    T = len(ids[0])
    for row in range(n):
        length = int(mask[row].sum())
        assert np.all(mask[row, :length] == 1) and np.all(mask[row, length:] == 0)
        assert ids[row][length:] == [PAD] * (T - length)
        assert np.all(lps[row, length:] == 0)
        body = ids[row][:length]
        eos_at = [i for i, t in enumerate(body) if t == EOS]
        if r.truncated[row]:
            assert eos_at == [] and length == T
        else:
            assert eos_at == [length - 1]  # the only EOS is the last masked token
    np.testing.assert_array_equal(r.lengths, mask.sum(axis=1).astype(np.int64))


# ----------------------------------------------------------------------------- log-probs

@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logprobs_equal_padded_full_forward(tiny, temperature):
    model, tok = tiny
    prompts = _prompts()
    params = SamplingParams(max_new_tokens=10, temperature=temperature)
    r = generate_rollout(model, tok, prompts, 3, params, mx.random.key(11))
    assert r.completion_ids.shape == (6, 10)
    assert r.row_prompts == [prompts[0]] * 3 + [prompts[1]] * 3
    _check_structure(r, 6)
    mask = _np(r.mask)
    sampler = _np(r.sampler_logprobs)
    # policy.logprob_pass: right-padded, length-sorted micro-batches, no cache
    recomputed = _np(logprob_pass(model, r, temperature, micro_batch=4, pad_id=PAD))
    np.testing.assert_allclose(recomputed * mask, sampler * mask, atol=1e-4, rtol=0)
    # forward.completion_logprobs on the whole packed batch
    batch = pack(r.row_prompts, r.completion_ids, r.mask, PAD)
    direct = _np(completion_logprobs(model, batch, temperature))
    np.testing.assert_allclose(direct * mask, sampler * mask, atol=1e-4, rtol=0)
    assert np.all(sampler[mask > 0] < 0)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_entropies_are_those_of_the_sampling_distribution(tiny, temperature):
    """H = -sum p log p of softmax(logits / T) at each sampled position, from a full forward pass."""
    model, tok = tiny
    r = generate_rollout(model, tok, _prompts(), 2, SamplingParams(6, temperature, top_k=5), mx.random.key(3))
    mask = _np(r.mask)
    for row, prompt in enumerate(r.row_prompts):
        ids = r.completion_ids[row].tolist()
        logits = _np(model(mx.array([prompt + ids]))[0]) / temperature  # [L, V]
        for t in range(int(mask[row].sum())):
            z = logits[len(prompt) - 1 + t]
            p = np.exp(z - z.max())
            p /= p.sum()
            expected = -(p * np.log(p)).sum()
            np.testing.assert_allclose(_np(r.entropies)[row, t], expected, rtol=1e-4, atol=1e-4)
    assert np.all(_np(r.entropies)[mask == 0] == 0)


def _sampled_with_logits(model, r: Rollout):
    """Check the sampler's log-probs are those of the full softmax (filters cut sampling, not log-probs),
    then yield (logits [V] the token was drawn from, the sampled token) for every sampled token."""
    mask = _np(r.mask)
    full = _np(logprob_pass(model, r, 1.0, micro_batch=8, pad_id=PAD))
    np.testing.assert_allclose(full * mask, _np(r.sampler_logprobs) * mask, atol=1e-4, rtol=0)
    for row, prompt in enumerate(r.row_prompts):
        length = int(mask[row].sum())
        seq = prompt + r.completion_ids[row].tolist()[:length]
        logits = _np(model(mx.array([seq]))[0])
        for t in range(length):
            yield logits[len(prompt) - 1 + t], seq[len(prompt) + t]


def test_top_k_samples_from_the_top_k_but_logprobs_are_unfiltered(tiny):
    model, tok = tiny
    params = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=3)
    r = generate_rollout(model, tok, _prompts(), 2, params, mx.random.key(5))
    # every sampled token is among the 3 most likely at its position
    for z, chosen in _sampled_with_logits(model, r):
        assert int((z > z[chosen]).sum()) < 3


@pytest.mark.parametrize("kind", ["top_p", "min_p"])
def test_top_p_and_min_p_keep_only_allowed_tokens(tiny, kind):
    """top_p 0.3: every sampled token lies in the smallest set of top tokens whose mass reaches 0.3;
    min_p 0.5: every sampled token has p >= 0.5 * p_max. Log-probs stay those of the full softmax."""
    model, tok = tiny
    extra = {"top_p": 0.3} if kind == "top_p" else {"min_p": 0.5}
    params = SamplingParams(max_new_tokens=6, temperature=1.0, **extra)
    r = generate_rollout(model, tok, _prompts(), 2, params, mx.random.key(9))
    for z, chosen in _sampled_with_logits(model, r):
        p = np.exp(z - z.max())
        p /= p.sum()
        if kind == "top_p":
            order = np.argsort(-p)
            keep = order[:int(np.searchsorted(np.cumsum(p[order]), 0.3)) + 1]
            assert chosen in keep.tolist()
        else:
            assert p[chosen] >= 0.5 * p.max() - 1e-6


# ----------------------------------------------------------------------------- keys

def test_same_key_same_rollout_different_key_differs(tiny):
    model, tok = tiny
    prompts = _prompts()
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    a = generate_rollout(model, tok, prompts, 3, params, mx.random.key(7))
    mx.random.seed(123)  # the global RNG state must not matter
    b = generate_rollout(model, tok, prompts, 3, params, mx.random.key(7))
    c = generate_rollout(model, tok, prompts, 3, params, mx.random.key(8))
    assert a.completion_ids.tolist() == b.completion_ids.tolist()
    assert a.texts == b.texts
    np.testing.assert_array_equal(_np(a.sampler_logprobs), _np(b.sampler_logprobs))
    assert a.completion_ids.tolist() != c.completion_ids.tolist()
    # the G samples of one prompt are not copies of each other at temperature 1
    rows = a.completion_ids.tolist()
    assert len({tuple(x) for x in rows[:3]}) > 1


# ----------------------------------------------------------------------------- EOS, mask, truncation

def test_forced_eos_ends_every_row_at_once(tiny):
    model, tok = tiny
    biased = Biased(model, {EOS: 1e4}, model.args.vocab_size)
    params = SamplingParams(max_new_tokens=20, temperature=1.0)
    r = generate_rollout(biased, tok, _prompts(), 2, params, mx.random.key(0), prefill_text="<think>")
    _check_structure(r, 4)
    T = r.completion_ids.shape[1]
    assert T < 20  # decoding stopped early once every row had ended
    assert r.completion_ids.tolist() == [[EOS] + [PAD] * (T - 1)] * 4
    assert _np(r.mask).tolist() == [[1.0] + [0.0] * (T - 1)] * 4
    assert not r.truncated.any()
    assert r.texts == ["<think>"] * 4  # prefill + completion without its EOS
    np.testing.assert_allclose(_np(r.sampler_logprobs)[:, 0], 0.0, atol=1e-5)


def test_mixed_eos_and_truncated_rows(tiny):
    model, tok = tiny
    biased = Biased(model, {EOS: 3.8}, model.args.vocab_size)
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    r = generate_rollout(biased, tok, _prompts(), 4, params, mx.random.key(3))
    _check_structure(r, 8)
    assert r.completion_ids.shape[1] == 10
    assert r.truncated.any() and not r.truncated.all()
    lengths = r.lengths
    assert len(set(lengths.tolist())) > 2
    for row in range(8):
        body = r.completion_ids[row].tolist()[:lengths[row]]
        expected = tok.decode(body[:-1] if body and body[-1] == EOS else body)
        assert r.texts[row] == expected
    # the ending EOS's log-prob is kept and equals the full forward's (through the generic path)
    mask = _np(r.mask)
    full = _np(logprob_pass(biased, r, 1.0, micro_batch=3, pad_id=PAD))
    np.testing.assert_allclose(full * mask, _np(r.sampler_logprobs) * mask, atol=1e-4, rtol=0)


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_finish_cuts_after_first_eos(tiny):
    _, tok = tiny
    rows = [
        _ids(tok, "ab") + [EOS] + _ids(tok, "cd"),  # EOS in the middle
        [EOS] + _ids(tok, "abcd"),  # EOS first
        _ids(tok, "abcd") + [EOS],  # EOS exactly at the last step: not truncated
        _ids(tok, "abcde"),  # no EOS: truncated
        _ids(tok, "a") + [EOS, EOS] + _ids(tok, "bc"),  # only the first EOS counts
    ]
    T = 5
    ids = mx.array(rows, dtype=mx.int32)
    lps = mx.array(-np.arange(1, 26, dtype=np.float32).reshape(5, 5) / 10)
    params = SamplingParams(max_new_tokens=T, temperature=1.0)
    r = finish_rollout(tok, [[5, 6]], ids, lps, mx.zeros(ids.shape), [EOS], PAD, params, 5, "pre:")
    lengths = [3, 1, 5, 5, 2]
    assert r.lengths.tolist() == lengths
    assert r.truncated.tolist() == [False, False, False, True, False]
    for row, length in enumerate(lengths):
        assert _np(r.mask)[row].tolist() == [1.0] * length + [0.0] * (T - length)
        assert r.completion_ids[row].tolist() == rows[row][:length] + [PAD] * (T - length)
        np.testing.assert_allclose(_np(r.sampler_logprobs)[row], _np(lps)[row] * ([1] * length + [0] * (T - length)))
    assert r.texts == ["pre:ab", "pre:", "pre:abcd", "pre:abcde", "pre:a"]
    _check_structure(r, 5)


def test_finish_stop_strings(tiny):
    _, tok = tiny
    rows = [
        _ids(tok, "abxcd"),  # one-token stop string in the middle
        _ids(tok, "xabcd"),  # at the first token
        _ids(tok, "ab") + [EOS] + _ids(tok, "xc"),  # EOS before the stop string: EOS wins
        _ids(tok, "a x") + [EOS] + _ids(tok, "c"),  # stop string before EOS: cut at the stop
        _ids(tok, "abcde"),  # neither: truncated
    ]
    ids = mx.array(rows, dtype=mx.int32)
    lps = mx.full((5, 5), -0.5)
    params = SamplingParams(max_new_tokens=5, temperature=1.0, stop=("x",))
    r = finish_rollout(tok, [[5]], ids, lps, mx.zeros(ids.shape), [EOS], PAD, params, 5, "")
    assert r.lengths.tolist() == [3, 1, 3, 3, 5]
    assert r.texts == ["abx", "x", "ab", "a x", "abcde"]
    assert r.truncated.tolist() == [False, False, False, False, True]
    assert r.completion_ids[0].tolist() == _ids(tok, "abx") + [PAD, PAD]
    assert r.completion_ids[3].tolist() == _ids(tok, "a x") + [PAD, PAD]


def test_finish_multi_token_stop_string(tiny):
    _, tok = tiny
    rows = [_ids(tok, "aa</answer>bb"), _ids(tok, "</ans</answ")]
    T = max(len(x) for x in rows)
    rows = [x + _ids(tok, "z") * (T - len(x)) for x in rows]
    params = SamplingParams(max_new_tokens=T, temperature=1.0, stop=("</answer>", "QQ"))
    r = finish_rollout(tok, [[5]], mx.array(rows, dtype=mx.int32), mx.zeros((2, T)), mx.zeros((2, T)), [EOS], PAD, params, 2, "P")
    assert r.lengths.tolist() == [len(_ids(tok, "aa</answer>")), T]
    assert r.texts[0] == "Paa</answer>" and r.texts[0].endswith("</answer>")
    assert r.truncated.tolist() == [False, True]


def test_stop_string_in_rollout_ends_decoding(tiny):
    model, tok = tiny
    (x,) = _ids(tok, "x")
    biased = Biased(model, {x: 1e4}, model.args.vocab_size)
    params = SamplingParams(max_new_tokens=20, temperature=1.0, stop=("x",))
    r = generate_rollout(biased, tok, _prompts(), 2, params, mx.random.key(1))
    T = r.completion_ids.shape[1]
    assert T < 20  # every row hit the stop string, so decoding ended at the next sync
    assert r.lengths.tolist() == [1, 1, 1, 1]
    assert r.texts == ["x"] * 4
    assert r.completion_ids.tolist() == [[x] + [PAD] * (T - 1)] * 4
    assert not r.truncated.any()


# ----------------------------------------------------------------------------- shared prefill / greedy

@pytest.fixture(scope="module")
def sharp(tiny_model_dir):
    """The tiny model with its projections scaled up: a plain random model's greedy decode repeats one
    token forever, this one's greedy tokens change from step to step (top-2 gaps stay > 1e-3)."""
    model, tok = load(str(tiny_model_dir))
    model.update(tree_map_with_path(lambda path, w: w * 4.0 if "proj" in path else w, model.parameters()))
    return model, tok


def test_greedy_rows_share_the_prompt_and_match_mlx_lm(sharp):
    model, tok = sharp
    prompts = _prompts() + [[1, 140, 3, 60]]
    n_new = 10
    params = SamplingParams(max_new_tokens=n_new, temperature=0.0)
    G = 3
    r = generate_rollout(model, tok, prompts, G, params, mx.random.key(0))
    rows = r.completion_ids.tolist()
    lps = _np(r.sampler_logprobs)
    mask = _np(r.mask)
    for b, prompt in enumerate(prompts):
        group = rows[b * G:(b + 1) * G]
        assert all(g == group[0] for g in group)
        assert len(set(group[0])) > 3  # a decode that actually moves
        ref_tokens, ref_lps = [], []
        for token, logprobs in generate_step(mx.array(prompt), model, max_tokens=n_new):
            token = int(token)
            ref_tokens.append(token)
            ref_lps.append(float(logprobs[token].item()))
            if token == EOS:
                break
        length = int(mask[b * G].sum())
        assert group[0][:length] == ref_tokens[:length]
        assert length == len(ref_tokens)
        for g in range(G):  # temperature 0: log-probs of the plain logits
            np.testing.assert_allclose(lps[b * G + g, :length], ref_lps, atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------- chat prompts

def test_encode_chat_prompt_appends_prefill_after_generation_prompt(tiny):
    _, tok = tiny
    ids, cut = encode_chat_prompt(tok, "What is 2+2?", "Be brief.", "<think>", 1000)
    assert not cut
    assert tok.decode(ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?"
                               "<|im_end|>\n<|im_start|>assistant\n<think>")
    # a system message already in the messages is not duplicated
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    ids2, _ = encode_chat_prompt(tok, msgs, "other", "", 1000)
    assert tok.decode(ids2) == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    # no system prompt: no system turn
    ids3, _ = encode_chat_prompt(tok, "U", "", "", 1000)
    assert tok.decode(ids3) == "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"


def test_encode_chat_prompt_cut_keeps_the_tail(tiny):
    _, tok = tiny
    full, cut = encode_chat_prompt(tok, "a fairly long question " * 4, "sys", "Answer:", 10_000)
    assert not cut
    same, cut = encode_chat_prompt(tok, "a fairly long question " * 4, "sys", "Answer:", len(full))
    assert same == full and not cut
    k = 20
    ids, cut = encode_chat_prompt(tok, "a fairly long question " * 4, "sys", "Answer:", k)
    assert cut and len(ids) == k and ids == full[-k:]
    assert tok.decode(ids).endswith("<|im_end|>\n<|im_start|>assistant\nAnswer:")


def test_encode_chat_prompt_without_template():
    class Plain:
        chat_template = None

        def encode(self, text):
            return [ord(c) for c in text]

    ids, cut = encode_chat_prompt(Plain(), "Q", "S", "P", 100)
    assert "".join(map(chr, ids)) == "S\n\nQ\nP" and not cut
    ids, cut = encode_chat_prompt(Plain(), "Q", "S", "P", 3)
    assert "".join(map(chr, ids)) == "Q\nP" and cut


# ----------------------------------------------------------------------------- static-cache decode

@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=20, temperature=1.0),
    SamplingParams(max_new_tokens=12, temperature=0.8, top_k=20, top_p=0.9),
    SamplingParams(max_new_tokens=9, temperature=0.0),
])
def test_static_cache_decode_equals_growing_cache_decode(tiny, params):
    """The fixed-capacity in-place decode samples the same tokens with the same log-probs as the
    step-by-step decode on mlx-lm's BatchKVCache (left padding and G-fold cache sharing included)."""
    model, tok = tiny
    key = mx.random.key(5)
    fast = generate_rollout(model, tok, _prompts(), 3, params, key, static_cache=True)
    slow = generate_rollout(model, tok, _prompts(), 3, params, key, static_cache=False)
    assert fast.completion_ids.tolist() == slow.completion_ids.tolist()
    np.testing.assert_allclose(_np(fast.sampler_logprobs), _np(slow.sampler_logprobs), atol=1e-5)
    np.testing.assert_array_equal(fast.truncated, slow.truncated)


def test_static_cache_falls_back_for_sliding_window_models(tiny):
    from mlx_lm.models.cache import RotatingKVCache

    from mlx_grpo.rollout.decode import supports_static_cache

    model, _ = tiny
    assert supports_static_cache(model)

    class Windowed:
        layers = model.layers

        def make_cache(self):
            return [RotatingKVCache(max_size=8) for _ in self.layers]

    assert not supports_static_cache(Windowed())


def test_kernel_path_decodes_like_the_growing_cache(tiny, monkeypatch):
    """The CUDA path minus the CUDA source: with the kernel stood in for by its reference
    (kernels.attention.left_padded_attention_reference), the kernel path (maskless static cache, per-step
    start/stop arrays, models/kernel_forward.decode_step) samples what mlx-lm's BatchKVCache decode samples,
    and mlx-lm's attention function is never swapped (nothing of mlx-lm is patched while it decodes)."""
    import mlx_lm.models.base as base_module
    import mlx_lm.models.llama as llama_module

    from mlx_grpo.kernels.attention import left_padded_attention_reference
    from mlx_grpo.rollout import decode as rollout_mod

    model, tok = tiny
    calls = []

    def reference(queries, *args, **kwargs):
        calls.append(llama_module.scaled_dot_product_attention is base_module.scaled_dot_product_attention)
        return left_padded_attention_reference(queries, *args, **kwargs).astype(queries.dtype)

    monkeypatch.setattr(rollout_mod, "left_padded_attention", reference)
    monkeypatch.setattr(rollout_mod, "kernel_serves", lambda m, head_dim: True)
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    routed = generate_rollout(model, tok, _prompts(), 3, params, mx.random.key(9))
    assert calls and all(calls)
    plain = generate_rollout(model, tok, _prompts(), 3, params, mx.random.key(9), static_cache=False)
    assert routed.completion_ids.tolist() == plain.completion_ids.tolist()
    np.testing.assert_allclose(_np(routed.sampler_logprobs), _np(plain.sampler_logprobs), atol=1e-5)


@pytest.mark.parametrize("family,tied", [("llama", True), ("llama", False), ("qwen2", True), ("qwen3", False)])
def test_kernel_forward_decode_step_is_the_models_own_call(family, tied):
    """models/kernel_forward.decode_step computes what mlx-lm's forward computes, bit for bit: the same
    logits as model(tokens, cache=...) at every step, on two copies of one prefilled static cache (without
    the kernel: attention through the cache's masked fallback), tied and untied heads, qwen2's biases,
    qwen3's q/k norms. A family whose forward it does not compute is refused."""
    import importlib

    from mlx_grpo.models.kernel_forward import decode_step, forward_matches
    from mlx_grpo.models.tiny import FAMILY_CONFIGS
    from mlx_grpo.rollout.decode import _prefill, _static_caches

    module = importlib.import_module(f"mlx_lm.models.{family}")
    config = {**FAMILY_CONFIGS[family], "model_type": family, "vocab_size": 300, "tie_word_embeddings": tied}
    mx.random.seed(3)
    model = module.Model(module.ModelArgs.from_dict(config))
    assert forward_matches(model)
    logits, prefilled = _prefill(model, _prompts(), pad_id=0)
    own = _static_caches(prefilled, 2, prefilled[0]._idx + 6, use_kernel=False)
    ours = _static_caches(prefilled, 2, prefilled[0]._idx + 6, use_kernel=False)
    token = mx.argmax(mx.repeat(logits, 2, axis=0), axis=-1)[:, None]  # [N, 1]
    for _ in range(6):
        want, got = model(token, cache=own), decode_step(model, token, ours)
        assert mx.array_equal(want, got).item()
        token = mx.argmax(want[:, -1], axis=-1)[:, None]

    phi3 = importlib.import_module("mlx_lm.models.phi3")
    other = phi3.Model(phi3.ModelArgs.from_dict({**FAMILY_CONFIGS["phi3"], "model_type": "phi3", "vocab_size": 300}))
    assert not forward_matches(other)


@pytest.mark.parametrize("seed", range(6))
def test_stop_scanner_finds_what_stop_cut_finds(tiny, seed):
    """Rows scanned as their tokens arrive, in chunks of any size: the scanner's cut is stop_cut's on the
    whole row at every scan, wherever the stop string falls (across chunks included)."""
    from mlx_grpo.rollout.sampler import StopScanner, stop_cut

    _, tok = tiny
    rng = np.random.default_rng(seed)
    stops = ("</calc>", "<|im_end|>x", "ab")
    pieces = ["a", "b", "c", "<", "/", "calc>", "</calc", ">", " ", "é", "<|im_end|>", "x", "12"]
    scanner = StopScanner(tok, stops)
    found = 0
    for row in range(20):
        ids = []
        for _ in range(int(rng.integers(1, 12))):
            for _ in range(int(rng.integers(1, 9))):
                ids += tok.encode(pieces[int(rng.integers(len(pieces)))], add_special_tokens=False)
            want = stop_cut(tok, ids, stops)
            assert scanner.cut(row, ids) == want, (row, tok.decode(ids))
            if want is not None:
                found += 1
                break
    assert 0 < found < 20  # rows with and without a stop, scanned more than once
