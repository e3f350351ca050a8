"""The CUDA sampler's draws (kernels/keyed_sampler.py), checked on the CPU: a numpy threefry2x32 written from
the Threefry paper with the counter layout the kernel uses reproduces MLX's own uniform draws per key, and
categorical_from_bits on those bits picks MLX's categorical token for every row. The kernel itself runs only
on CUDA; tests/test_cuda_kernels.py (the gpu tier) compares it with MLX there."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_grpo.kernels import keyed_sampler
from mlx_grpo.kernels.keyed_sampler import categorical_from_bits, gumbel_from_bits
from mlx_grpo.rollout import sampler
from mlx_grpo.rollout.rollout_records import SamplingParams

ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))  # Threefry-2x32's, Salmon et al. 2011, table 4
MASK = np.uint64(0xFFFFFFFF)


def threefry2x32(k0: int, k1: int, c0: np.ndarray, c1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """20 rounds, a key injection after every 4, the third key word k0 ^ k1 ^ 0x1BD11BDA."""
    ks = [np.uint64(k0), np.uint64(k1), np.uint64(k0) ^ np.uint64(k1) ^ np.uint64(0x1BD11BDA)]
    x, y = (c0.astype(np.uint64) + ks[0]) & MASK, (c1.astype(np.uint64) + ks[1]) & MASK
    for i in range(5):
        for r in ROTATIONS[i % 2]:
            x = (x + y) & MASK
            y = (((y << np.uint64(r)) | (y >> np.uint64(32 - r))) & MASK) ^ x
        x = (x + ks[(i + 1) % 3]) & MASK
        y = (y + ks[(i + 2) % 3] + np.uint64(i + 1)) & MASK
    return x.astype(np.uint32), y.astype(np.uint32)


def layout_bits(keys: mx.array, vocab: int) -> mx.array:
    """The kernel's layout: row r's words y and y + H from one hash of counters (y, y + H), H = ceil(V / 2);
    an odd V hashes (H - 1, 0) last and keeps only its first word."""
    half = (vocab + 1) // 2
    y = np.arange(half, dtype=np.uint64)
    out = np.zeros((keys.shape[0], vocab), dtype=np.uint32)
    for r, (k0, k1) in enumerate(np.array(keys).tolist()):
        last = (y == half - 1) & bool(vocab % 2)
        a, b = threefry2x32(k0, k1, y, np.where(last, 0, y + half))
        out[r, :half], out[r, half:] = a, b[:vocab - half]
    return mx.array(out)


@pytest.mark.parametrize("vocab", [1, 7, 10, 11, 4099])
def test_layout_reproduces_mlx_uniform_draws(vocab):
    keys = mx.random.split(mx.random.key(vocab), 6)
    want = mx.vmap(lambda key: mx.random.uniform(shape=(vocab,), key=key))(keys)
    below_one = np.nextafter(np.float32(1), np.float32(0))
    got = np.minimum(np.array(layout_bits(keys, vocab)).astype(np.float32) / np.float32(4294967295.0), below_one)
    assert np.array_equal(np.array(want), got)


@pytest.mark.parametrize("vocab", [1, 7, 4099, 49152])
def test_gumbel_from_bits_is_mlx_gumbel_noise(vocab):
    """The noise itself, bit for bit (tokens alone would not see a change that keeps every argmax)."""
    keys = mx.random.split(mx.random.key(vocab + 1), 8)
    want = mx.vmap(lambda key: mx.random.gumbel(shape=(vocab,), key=key))(keys)
    bits = layout_bits(keys, vocab)
    assert np.array_equal(np.array(want), np.array(gumbel_from_bits(bits)))
    assert np.array_equal(np.array(want), np.array(mx.compile(gumbel_from_bits)(bits)))


@pytest.mark.parametrize("vocab,scale", [(11, 3.0), (1000, 0.05), (4099, 3.0), (49152, 1.0)])
def test_categorical_from_bits_picks_mlx_categorical_tokens(vocab, scale):
    rows = 64
    logits = mx.random.normal((rows, vocab), key=mx.random.key(rows + vocab)) * scale
    filtered = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    keys = mx.random.split(mx.random.key(vocab), rows)
    want = mx.vmap(lambda row, key: mx.random.categorical(row, key=key))(filtered, keys)
    bits = layout_bits(keys, vocab)
    assert want.tolist() == categorical_from_bits(filtered, bits).tolist()
    assert want.tolist() == mx.compile(categorical_from_bits)(filtered, bits).tolist()  # as the sampler runs it


def test_sample_through_the_keyed_path_draws_the_same_tokens(monkeypatch):
    """sample() on CUDA feeds keyed_bits(keys, V) to categorical_from_bits after the top-k / top-p cuts: with the
    layout standing in for the kernel, tokens, log-probs and entropies equal the vmapped categorical's."""
    params = SamplingParams(max_new_tokens=4, temperature=0.9, top_p=0.95, top_k=50)
    logits = mx.random.normal((48, 300), key=mx.random.key(5)) * 2
    keys = mx.random.split(mx.random.key(9), 48)
    want = sampler.sample(logits, keys, params)
    monkeypatch.setattr(keyed_sampler, "available", lambda: True)
    monkeypatch.setattr(keyed_sampler, "keyed_bits", layout_bits)
    got = sampler.sample(logits, keys, params)
    for a, b in zip(want, got):
        assert a.tolist() == b.tolist()


def test_the_top_bits_stay_below_one():
    """MLX caps u at the float below 1: the top 128 bit patterns divide to 1.0 in float32, and -log(-log(1))
    would be infinite (a draw of ~3e-8 per token that random keys never hit in a test)."""
    top = mx.array([[0xFFFFFFFF, 0xFFFFFF80, 0xFFFFFF7F]], dtype=mx.uint32)
    noise = np.array(gumbel_from_bits(top))
    below_one = np.nextafter(np.float32(1), np.float32(0))
    assert np.isfinite(noise).all() and noise[0, 0] == noise[0, 1] == np.float32(-np.log(-np.log(below_one)))
