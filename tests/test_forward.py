"""The training forward (models/forward.py) against naive references written from the formula.

Token log-probs, the packed model pass (right padding must not change log-probs), the chunked output
head (soft-capped too, as nanochat's) against autograd through the full logits, and layer checkpointing.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from mlx_grpo.models.forward import CUDA_PACK_BUCKET, completion_logprobs, pack, pack_bucket, token_logprobs

RTOL = 1e-5
ATOL = 1e-6


# ----------------------------------------------------------------------------- naive references

def naive_token_logprobs(logits, tokens, temperature):
    logits = np.asarray(logits, dtype=np.float64)
    tokens = np.asarray(tokens)
    N, T, V = logits.shape
    out = np.zeros((N, T))
    for n in range(N):
        for t in range(T):
            row = logits[n, t] / temperature
            m = row.max()
            lse = m + math.log(sum(math.exp(v - m) for v in row))
            out[n, t] = row[tokens[n, t]] - lse
    return out


def np_(x):
    return np.array(x.astype(mx.float32).tolist(), dtype=np.float64)


# ----------------------------------------------------------------------------- token log-probs

@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_token_logprobs_match_naive(temperature):
    rng = np.random.default_rng(2)
    N, T, V = 3, 5, 17
    logits = (rng.normal(size=(N, T, V)) * 3.0).astype(np.float32)
    tokens = rng.integers(0, V, size=(N, T)).astype(np.int32)
    got = token_logprobs(mx.array(logits), mx.array(tokens), temperature)
    assert got.shape == (N, T) and got.dtype == mx.float32
    np.testing.assert_allclose(np_(got), naive_token_logprobs(logits, tokens, temperature), rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------------------- packed model pass

@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load(str(tiny_model_dir))


def _naive_completion_logprobs(model, prompt, completion, temperature):
    """Run the model on the unpadded prompt+completion alone; log softmax(logits/T) in float64."""
    x = mx.array([prompt + completion], dtype=mx.int32)
    logits = np.array(model(x)[0].astype(mx.float32).tolist(), dtype=np.float64)  # [L, V]
    out = []
    for t, token in enumerate(completion):
        row = logits[len(prompt) - 1 + t] / temperature
        m = row.max()
        out.append(row[token] - (m + math.log(np.exp(row - m).sum())))
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("multiple", [None, CUDA_PACK_BUCKET])
def test_completion_logprobs_packed_equal_unpadded(tiny, temperature, multiple):
    model, tok = tiny
    pad_id = tok.pad_token_id
    rng = np.random.default_rng(5)
    V = model.args.vocab_size
    prompt_lengths = [3, 9, 1, 6]
    comp_lengths = [5, 2, 7, 1]
    T = max(comp_lengths)
    prompts = [rng.integers(3, V, size=k).tolist() for k in prompt_lengths]
    comps = [rng.integers(0, V, size=k).tolist() for k in comp_lengths]
    ids = np.full((len(prompts), T), pad_id, dtype=np.int32)
    mask = np.zeros((len(prompts), T), dtype=np.float32)
    for r, c in enumerate(comps):
        ids[r, :len(c)] = c
        mask[r, :len(c)] = 1
    batch = pack(prompts, mx.array(ids), mx.array(mask), pad_id, multiple)
    step = multiple or pack_bucket()
    width = -(-(max(prompt_lengths) + T) // step) * step
    assert batch.inputs.shape == (4, width)
    got = np_(completion_logprobs(model, batch, temperature))
    assert got.shape == (4, T)
    for r in range(len(prompts)):
        expected = _naive_completion_logprobs(model, prompts[r], comps[r], temperature)
        np.testing.assert_allclose(got[r, :len(comps[r])], expected, rtol=RTOL, atol=1e-5)


@pytest.mark.parametrize("device, cuda, expected", [
    ("cpu", False, 64),  # a CPU build
    ("gpu", False, 64),  # Metal: no fused attention backward
    ("cpu", True, 64),  # a CUDA build whose default device is the CPU
    ("gpu", True, CUDA_PACK_BUCKET),
])
def test_pack_bucket_is_128_only_on_a_cuda_gpu(monkeypatch, device, cuda, expected):
    """cuDNN's fused attention backward needs lengths in multiples of 128; elsewhere widths stay at 64."""
    monkeypatch.setattr(mx.cuda, "is_available", lambda: cuda)
    # what mx.default_device() returns: a Device (index 0), not the DeviceType mx.gpu / mx.cpu
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(getattr(mx, device), 0))
    assert pack_bucket() == expected


def test_completion_logprobs_generic_path_equals_head_path(tiny):
    """Models outside LOGIT_SPLITS take the full-logits path; both must agree."""
    model, tok = tiny

    class Wrapped:  # no model_type: forces the model(x) path
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, x):
            return self.inner(x)

    rng = np.random.default_rng(6)
    prompts = [rng.integers(3, 200, size=k).tolist() for k in (4, 2)]
    ids = mx.array(rng.integers(3, 200, size=(2, 5)).astype(np.int32))
    mask = mx.array(np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], np.float32))
    batch = pack(prompts, ids, mask, tok.pad_token_id)
    a = np_(completion_logprobs(model, batch, 0.9))
    b = np_(completion_logprobs(Wrapped(model), batch, 0.9))
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_chunked_head_logprobs_and_gradients_equal_one_chunk(tiny, chunk):
    """Log-probs computed in checkpointed token chunks equal the one-chunk pass, and so do the
    gradients of every weight (the head's included)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mlx_grpo.models.forward import head_logprobs

    model, tok = tiny
    rng = np.random.default_rng(8)
    prompts = [rng.integers(3, 200, size=k).tolist() for k in (4, 2, 6)]
    ids = mx.array(rng.integers(3, 200, size=(3, 5)).astype(np.int32))
    mask = mx.array(np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], np.float32))
    batch = pack(prompts, ids, mask, tok.pad_token_id)
    weights = mx.array(rng.normal(size=(3, 5)).astype(np.float32)) * mask

    def loss(_m, chunk_tokens):
        return (completion_logprobs(model, batch, 0.8, chunk_tokens) * weights).sum()

    grad_fn = nn.value_and_grad(model, loss)
    whole, g_whole = grad_fn(model, 10_000)
    chunked, g_chunked = grad_fn(model, chunk)
    assert whole.item() == pytest.approx(chunked.item(), rel=1e-6)
    for (k, a), (_, b) in zip(tree_flatten(g_whole), tree_flatten(g_chunked)):  # float32 sums in another order
        np.testing.assert_allclose(np_(a), np_(b), rtol=1e-4, atol=1e-6, err_msg=k)
    hidden = mx.random.normal((2, 4, model.args.hidden_size))
    targets = mx.array(rng.integers(0, 200, size=(2, 4)).astype(np.int32))
    np.testing.assert_allclose(np_(head_logprobs(model, hidden, targets, 1.0, chunk)),
                               np_(head_logprobs(model, hidden, targets, 1.0)), rtol=RTOL, atol=1e-6)


def test_checkpointed_layers_give_the_same_logprobs_and_gradients(tiny):
    """grad_checkpoint recomputes each layer in the backward pass: values and gradients are unchanged."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    model, tok = tiny
    rng = np.random.default_rng(9)
    prompts = [rng.integers(3, 200, size=k).tolist() for k in (5, 3)]
    ids = mx.array(rng.integers(3, 200, size=(2, 4)).astype(np.int32))
    mask = mx.array(np.array([[1, 1, 1, 1], [1, 1, 0, 0]], np.float32))
    batch = pack(prompts, ids, mask, tok.pad_token_id)

    def loss(_m, checkpoint_layers):
        return (completion_logprobs(model, batch, 1.0, checkpoint_layers=checkpoint_layers) * mask).sum()

    grad_fn = nn.value_and_grad(model, loss)
    plain, g_plain = grad_fn(model, False)
    ckpt, g_ckpt = grad_fn(model, True)
    assert plain.item() == pytest.approx(ckpt.item(), rel=1e-6)
    for (k, a), (_, b) in zip(tree_flatten(g_plain), tree_flatten(g_ckpt)):
        np.testing.assert_allclose(np_(a), np_(b), rtol=1e-5, atol=1e-7, err_msg=k)


# ----------------------------------------------------------------------------- soft-capped head (nanochat)

CAP = 15.0


@pytest.mark.parametrize("softcap", [None, CAP])
@pytest.mark.parametrize("temperature", [0.7, 1.3])
@pytest.mark.parametrize("chunk", [1, 3, 5, 13, 20])
def test_linear_head_logprobs_and_gradients_match_autograd_of_naive_formula(chunk, temperature, softcap):
    """The hand-written chunked backward equals autograd through token_logprobs(cap * tanh(h @ W.T / cap)),
    for both gradients, at chunk sizes that do and do not divide M = 13."""
    from mlx_grpo.models.forward import linear_head_logprobs

    rng = np.random.default_rng(10)
    M, D, V = 13, 16, 29
    hidden = mx.array(rng.normal(size=(M, D)).astype(np.float32))
    weight = mx.array((rng.normal(size=(V, D)) * 5.0).astype(np.float32))  # raw logits u ~ 20: tanh bends
    targets = mx.array(rng.integers(0, V, size=M).astype(np.int32))
    cot = mx.array(rng.normal(size=M).astype(np.float32))  # a non-uniform cotangent for lp

    def naive(h, w):
        u = h @ w.T  # [M, V]
        return token_logprobs(u if softcap is None else softcap * mx.tanh(u / softcap), targets, temperature)

    def chunked(h, w):
        return linear_head_logprobs(h, w, targets, temperature, chunk, softcap)

    for fn in (naive, chunked):
        assert fn(hidden, weight).shape == (M,)
    np.testing.assert_allclose(np_(chunked(hidden, weight)), np_(naive(hidden, weight)), rtol=1e-5, atol=1e-5)
    grads = [mx.grad(lambda h, w: (fn(h, w) * cot).sum(), argnums=(0, 1))(hidden, weight)
             for fn in (chunked, naive)]
    for name, got, expected in zip(("d hidden", "d weight"), grads[0], grads[1]):
        np.testing.assert_allclose(np_(got), np_(expected), rtol=1e-5, atol=1e-5, err_msg=name)
    if softcap is not None:  # the case is one where dropping the cap or its derivative 1 - tanh^2 shows
        t = mx.tanh(hidden @ weight.T / softcap)
        assert mx.mean(t * t).item() > 0.3
        assert np.abs(np_(naive(hidden, weight)) - np_(token_logprobs(hidden @ weight.T, targets,
                                                                      temperature))).max() > 1.0


NANOCHAT_ARGS = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=97, intermediate_size=128, max_position_embeddings=128)


@pytest.fixture(scope="module")
def tiny_nanochat():
    """mlx-lm's nanochat with random weights; the head is scaled up so its raw logits (~25) reach well
    into the soft cap's tanh, where the cap and its derivative change log-probs and gradients."""
    from mlx_lm.models import nanochat

    mx.random.seed(11)
    model = nanochat.Model(nanochat.ModelArgs(**NANOCHAT_ARGS))
    model.lm_head.weight = mx.random.normal(model.lm_head.weight.shape) * 5.0
    mx.eval(model.parameters())
    return model


def _nanochat_batch(seed=12):
    rng = np.random.default_rng(seed)
    V = NANOCHAT_ARGS["vocab_size"]
    prompts = [rng.integers(1, V, size=k).tolist() for k in (4, 2, 6)]
    ids = mx.array(rng.integers(1, V, size=(3, 5)).astype(np.int32))
    mask = mx.array(np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], np.float32))
    return pack(prompts, ids, mask, 0), mx.array(rng.normal(size=(3, 5)).astype(np.float32)) * mask


def _full_logits_logprobs(model, batch, temperature):
    """log softmax(model(inputs) / T) at the completion positions: mlx-lm's own logits, soft cap included."""
    full = model(batch.inputs)  # [n, L, V]
    return token_logprobs(mx.take_along_axis(full, batch.positions[..., None], axis=1), batch.targets,
                          temperature)


def _forbid_full_logits(monkeypatch, model):
    """Make model(inputs) raise: the log-probs must come from the hidden states at the completion positions."""
    def full_logits(*_args, **_kwargs):
        raise AssertionError("completion_logprobs built the full [n, L, V] logits")

    monkeypatch.setattr(type(model), "__call__", full_logits)


@pytest.mark.parametrize("chunk", [3, 10_000])  # chunked custom VJP, and the one-chunk (n*T <= chunk) path
def test_nanochat_completion_logprobs_and_gradients_equal_full_logits(tiny_nanochat, chunk, monkeypatch):
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    model, temperature = tiny_nanochat, 0.8
    batch, weights = _nanochat_batch()

    def loss(_m, path):
        return (path(model, batch, temperature) * weights).sum()

    grad_fn = nn.value_and_grad(model, loss)
    expected = _full_logits_logprobs(model, batch, temperature)
    value_full, g_full = grad_fn(model, _full_logits_logprobs)
    # Without the cap the log-probs would be far off: the test can tell.
    raw = model.lm_head(model.transformer(batch.inputs))
    uncapped = token_logprobs(mx.take_along_axis(raw, batch.positions[..., None], axis=1), batch.targets,
                              temperature)
    assert np.abs(np_((uncapped - expected) * batch.mask)).max() > 1.0

    _forbid_full_logits(monkeypatch, model)
    got = completion_logprobs(model, batch, temperature, chunk)
    assert got.shape == (3, 5)
    np.testing.assert_allclose(np_(got), np_(expected), rtol=1e-5, atol=1e-5)
    for checkpoint_layers in (False, True):
        value, g_got = grad_fn(model, lambda *a: completion_logprobs(*a, chunk,
                                                                     checkpoint_layers=checkpoint_layers))
        assert value.item() == pytest.approx(value_full.item(), rel=1e-5)
        flat_got, flat_full = tree_flatten(g_got), tree_flatten(g_full)
        assert [k for k, _ in flat_got] == [k for k, _ in flat_full] and len(flat_got) > 10
        for (k, a), (_, b) in zip(flat_got, flat_full):
            np.testing.assert_allclose(np_(a), np_(b), rtol=1e-4, atol=1e-5, err_msg=k)


def test_nanochat_layers_are_checkpointed(tiny_nanochat, monkeypatch):
    """grad_checkpoint has an effect for nanochat: each of its blocks runs under mx.checkpoint, and the
    blocks are the model's own again afterwards."""
    from mlx_grpo.models import forward as forward_mod

    calls = []
    real = forward_mod.mx.checkpoint
    monkeypatch.setattr(forward_mod.mx, "checkpoint", lambda fn: calls.append(fn) or real(fn))
    blocks = list(tiny_nanochat.transformer.h)
    batch, _ = _nanochat_batch()
    completion_logprobs(tiny_nanochat, batch, 1.0, checkpoint_layers=True)
    assert len(calls) == len(blocks) > 1
    assert all(a is b for a, b in zip(tiny_nanochat.transformer.h, blocks))
    assert forward_mod.supports_layer_checkpointing(tiny_nanochat)


def test_quantized_nanochat_head_is_soft_capped_too(tiny_nanochat, monkeypatch):
    """A quantized head (sampling-side passes) takes the project-chunk-by-chunk path: capped as well."""
    import mlx.nn as nn
    from mlx_lm.models import nanochat

    model = nanochat.Model(nanochat.ModelArgs(**NANOCHAT_ARGS))
    model.update(tiny_nanochat.parameters())
    nn.quantize(model, group_size=32, bits=8)
    assert isinstance(model.lm_head, nn.QuantizedLinear)
    batch, _ = _nanochat_batch(13)
    expected = _full_logits_logprobs(model, batch, 0.8)
    _forbid_full_logits(monkeypatch, model)
    got = completion_logprobs(model, batch, 0.8, 3)
    np.testing.assert_allclose(np_(got), np_(expected), rtol=1e-5, atol=1e-5)
