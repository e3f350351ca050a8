"""The CUDA kernels (src/mlx_grpo/kernels/) against their plain-MLX references. The tests marked gpu run on a CUDA
device and are skipped without one (tests/conftest.py): on a GPU machine, `.venv/bin/python -m pytest -q -m gpu`.
The references themselves, and the coverage of the kernels' layouts, are checked here on any machine against
numpy written from the formulas."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_grpo import kernels
from mlx_grpo.kernels.cache_write import write_rows, write_rows_reference
from mlx_grpo.kernels.attention import (HEAD_DIMS, left_padded_attention, left_padded_attention_lse,
                                        left_padded_attention_lse_reference, left_padded_attention_reference)
from mlx_grpo.kernels.fused_attention import fused_decode_attention, fused_decode_attention_reference, fused_split
from mlx_grpo.kernels.keyed_sampler import (categorical, categorical_reference, gumbel_from_bits, gumbel_reference,
                                            keyed_bits)

from test_keyed_bits import layout_bits

# 64 rows run the fused kernel with one warp per (row, head), 256 with its split (fused_split); 63 and 255 leave
# the last block part idle (warps past the rows must write nothing)
ROWS = (64, 256, 63, 255)
HEADS, KV_HEADS, SLOTS, STOP = 9, 3, 300, 211
# bf16 values ~N(0, 1): rounding errors of ~2^-8 relative; anything larger is a bug
TOLERANCE = 2e-2


def attention_case(D: int, N: int, dtype=mx.bfloat16) -> dict:
    """Random left-padded rows over a stacked two-layer cache [2, N, Hkv, S, D]; row 0 of the fused case starts at
    `stop` (no cached slot: its own slot only)."""
    mx.random.seed(D + N)
    start = mx.random.randint(0, 150, (N,)).astype(mx.int32)
    return {"q": mx.random.normal((N, HEADS, 1, D)).astype(dtype),
            "k": mx.random.normal((2, N, KV_HEADS, SLOTS, D)).astype(dtype),
            "v": mx.random.normal((2, N, KV_HEADS, SLOTS, D)).astype(dtype),
            "start": start, "stop": mx.array([STOP], dtype=mx.int32), "scale": D ** -0.5,
            "qkv": mx.random.normal((N, (HEADS + 2 * KV_HEADS) * D)).astype(dtype),
            "positions": mx.random.randint(150, 400, (N,)).astype(mx.int32),
            "theta": (10000.0 ** (-mx.arange(0, D, 2) / D)).astype(mx.float32),
            "fused_start": mx.concatenate([mx.array([STOP], dtype=mx.int32), start[1:]])}


def fused_args(c: dict) -> tuple:
    return (c["qkv"], c["k"], c["v"], c["fused_start"], c["stop"], c["positions"], c["theta"], c["scale"], HEADS, 1)


def max_error(got: mx.array, want: mx.array) -> float:
    return mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()


def test_the_cases_run_both_fused_layouts():
    assert {fused_split(N, HEADS, D)[0] for D in HEAD_DIMS for N in ROWS} == {1, 4}


def test_the_attention_references_are_the_formulas():
    """Each reference against a per-row numpy loop of softmax(q k^T * scale) v over the row's slots (float32
    inputs, where the references' rounding to the input dtype changes nothing)."""
    D, N = 64, 5
    c = attention_case(D, N, mx.float32)
    q, k, v = (np.array(c[x], dtype=np.float64) for x in "qkv")
    start, scale, group = np.array(c["start"]), c["scale"], HEADS // KV_HEADS

    def attend(query, keys, values):  # [D], [S, D], [S, D] -> (out [D], lse)
        scores = keys @ query * scale
        top = scores.max()
        weights = np.exp(scores - top)
        return weights @ values / weights.sum(), top + np.log(weights.sum())

    plain = np.array(left_padded_attention_reference(c["q"], c["k"][1], c["v"][1], scale, c["start"], c["stop"]))
    out, lse = (np.array(x) for x in left_padded_attention_lse_reference(c["q"], c["k"], c["v"], scale, c["start"],
                                                                         c["stop"], 1))
    qkv = np.array(c["qkv"], dtype=np.float64).reshape(N, HEADS + 2 * KV_HEADS, D)
    angle = np.array(c["positions"])[:, None] * np.array(c["theta"])[None]  # [N, D / 2]

    def rope(x, r):  # rotate-half
        a, b = x[:D // 2], x[D // 2:]
        cos, sin = np.cos(angle[r]), np.sin(angle[r])
        return np.concatenate([a * cos - b * sin, b * cos + a * sin])

    fused, new_k, new_v = (np.array(x) for x in fused_decode_attention_reference(*fused_args(c)))
    fused_start = np.array(c["fused_start"])
    for r in range(N):
        for h in range(HEADS):
            kv = h // group
            want, want_lse = attend(q[r, h, 0], k[1, r, kv, start[r]:STOP], v[1, r, kv, start[r]:STOP])
            np.testing.assert_allclose(plain[r, h, 0], want, atol=1e-5)
            np.testing.assert_allclose(out[r, h, 0], want, atol=1e-5)
            np.testing.assert_allclose(lse[r, h, 0], want_lse, atol=1e-5)
            own_k, own_v = rope(qkv[r, HEADS + kv], r), qkv[r, HEADS + KV_HEADS + kv]
            keys = np.concatenate([k[1, r, kv, fused_start[r]:STOP], own_k[None]])
            values = np.concatenate([v[1, r, kv, fused_start[r]:STOP], own_v[None]])
            np.testing.assert_allclose(fused[r, h, 0], attend(rope(qkv[r, h], r), keys, values)[0], atol=1e-5)
            np.testing.assert_allclose(new_k[r, kv, 0], own_k, atol=1e-5)
            np.testing.assert_allclose(new_v[r, kv, 0], own_v, atol=1e-6)
    # a row with no slot in [start, stop): out 0, lse -inf (the kernel's contract with its caller's merge)
    empty = mx.array([STOP] * N, dtype=mx.int32)
    out, lse = left_padded_attention_lse_reference(c["q"], c["k"], c["v"], scale, empty, c["stop"], 1)
    assert (np.array(out) == 0).all() and np.isneginf(np.array(lse)).all()


@pytest.mark.gpu
def test_the_kernels_serve_on_this_device():
    assert kernels.available(), "a CUDA device without the kernels: MLX's default device is not the GPU"


@pytest.mark.gpu
@pytest.mark.parametrize("D,N", [(D, N) for D in HEAD_DIMS for N in ROWS])
def test_decode_attention_kernels_match_their_references(D, N):
    """The plain, log-sum-exp and fused (RoPE + the token's own slot) kernels, both fused layouts (split and
    not), every head dim they serve: within bf16 rounding of their float32 references."""
    c = attention_case(D, N)
    plain = left_padded_attention(c["q"], c["k"][1], c["v"][1], c["scale"], c["start"], c["stop"])
    want = left_padded_attention_reference(c["q"], c["k"][1], c["v"][1], c["scale"], c["start"], c["stop"])
    out, lse = left_padded_attention_lse(c["q"], c["k"], c["v"], c["scale"], c["start"], c["stop"], 1)
    want_out, want_lse = left_padded_attention_lse_reference(c["q"], c["k"], c["v"], c["scale"], c["start"],
                                                             c["stop"], 1)
    fused, new_k, new_v = fused_decode_attention(*fused_args(c))
    want_fused, want_k, want_v = fused_decode_attention_reference(*fused_args(c))
    errors = {"plain": max_error(plain, want), "lse_out": max_error(out, want_out), "lse": max_error(lse, want_lse),
              "fused": max_error(fused, want_fused),
              "fused_key": (mx.abs(new_k.astype(mx.float32) - want_k.astype(mx.float32))  # relative: keys reach ~5
                            / mx.maximum(mx.abs(want_k.astype(mx.float32)), 1)).max().item(),
              "fused_value": max_error(new_v, want_v)}
    assert all(e < TOLERANCE for e in errors.values()), errors  # a NaN fails too


@pytest.mark.gpu
@pytest.mark.parametrize("rows,vocab", [(256, 49152), (64, 151936), (300, 1001)])
def test_keyed_sampler_draws_mlx_bits_noise_and_tokens(rows, vocab):
    """The keyed bits are the threefry counters' words (tests/test_keyed_bits.layout_bits) bit for bit, their
    noise mx.random.gumbel's, and `categorical` (the sampler's call, the kernel here) draws the vmapped
    mx.random.categorical's tokens, over the vocabularies it meets (odd and even)."""
    logits = mx.random.normal((rows, vocab), key=mx.random.key(vocab)) * 3
    keys = mx.random.split(mx.random.key(rows), rows)
    bits = keyed_bits(keys, vocab)
    assert mx.array_equal(bits, layout_bits(keys, vocab)).item()
    assert mx.array_equal(gumbel_from_bits(bits), gumbel_reference(keys, vocab)).item()
    assert categorical(logits, keys).tolist() == categorical_reference(logits, keys).tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True])
def test_the_fused_step_writes_the_cache_as_the_loop_did(tmp_path, graph):
    """write_in_step: the fused kernel writes each token's keys and values into the engine's cache in place, where
    the loop wrote them outside the step (a copy of the cache each step). Over three batch steps decoded together
    (compaction and refills between steps), every token and log-prob equals the loop's writes' to the bit: the
    same values land in the same slots."""
    from mlx_lm import load

    from mlx_grpo.models import decoder
    from mlx_grpo.models.tiny import write_tiny_model
    from mlx_grpo.rollout.engine import RolloutEngine
    from mlx_grpo.rollout.rollout_records import SamplingParams

    model, tokenizer = load(str(write_tiny_model(tmp_path / "m", hidden=128, layers=3)))  # 2 heads of 64
    model.set_dtype(mx.bfloat16)
    prompts = [[[5 + (j * 7 + i) % 20] * (3 + i + j) for i in range(4)] for j in range(3)]
    jobs = [(p, mx.random.split(mx.random.key(j), 16)) for j, p in enumerate(prompts)]
    params = SamplingParams(48, 1.0)
    out = {}
    for writes in (True, False):
        engine = RolloutEngine(tokenizer, mode="copy", graph=graph, write_in_step=writes).refresh(model)
        assert decoder.fused_serves(engine.spec, decoder.kernel_serves(engine.spec))
        out[writes] = engine.generate_many(jobs, 4, params)
    for got, want in zip(out[True], out[False]):
        assert (np.array(got.completion_ids) == np.array(want.completion_ids)).all()
        assert (np.array(got.sampler_logprobs) == np.array(want.sampler_logprobs)).all()
    assert len({int(x) for r in out[True] for x in np.array(r.mask).sum(axis=1)}) > 1  # rows ended apart


def cache_write_case(dtype=mx.bfloat16) -> tuple:
    """A [2, 6, 3, 40, 64] cache, a block of 3 rows x 7 slots for rows 4, 0, 5 at slots 20..26."""
    mx.random.seed(5)
    return (mx.random.normal((2, 6, 3, 40, 64)).astype(dtype), mx.random.normal((2, 6, 3, 40, 64)).astype(dtype),
            mx.random.normal((2, 3, 3, 7, 64)).astype(dtype), mx.random.normal((2, 3, 3, 7, 64)).astype(dtype),
            np.array([4, 0, 5]), 20)


def test_the_cache_write_reference_is_the_formula():
    keys, values, block_k, block_v, slots, at = cache_write_case(mx.float32)
    want_k, want_v = np.array(keys), np.array(values)
    for i, row in enumerate(slots):
        want_k[:, row, :, at:at + 7] = np.array(block_k)[:, i]
        want_v[:, row, :, at:at + 7] = np.array(block_v)[:, i]
    got_k, got_v = write_rows_reference(keys, values, block_k, block_v, slots, at)
    assert np.array_equal(np.array(got_k), want_k) and np.array_equal(np.array(got_v), want_v)


@pytest.mark.gpu
def test_the_cache_write_kernel_writes_the_reference_in_place():
    keys, values, block_k, block_v, slots, at = cache_write_case()
    want_k, want_v = write_rows_reference(mx.array(keys), mx.array(values), block_k, block_v, slots, at)
    mx.eval(want_k, want_v)  # before the kernel writes the buffers they were computed from
    got_k, got_v = write_rows(keys, values, block_k, block_v, slots, at)
    assert got_k is keys and got_v is values  # the same arrays, their buffers written
    assert mx.array_equal(got_k, want_k).item() and mx.array_equal(got_v, want_v).item()
    # the write is only queued: with its inputs still lazy (computed in its own graph) a read queued right after it
    # sees it, on the one stream
    keys, values, block_k, block_v, slots, at = cache_write_case()
    lazy_k, lazy_v = mx.contiguous(keys * 1), mx.contiguous(values * 1)
    got_k, got_v = write_rows(lazy_k, lazy_v, block_k + 0, block_v + 0, slots, at)
    assert mx.array_equal(got_k, want_k).item() and mx.array_equal(got_v, want_v).item()
