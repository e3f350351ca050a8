"""Image rollouts decode through the one decode loop (rollout/loop.decode_rows, issue 46) and sample exactly what
their own per-step loop sampled before it was folded in: `reference_vision_rollout` below is a frozen copy of that
loop (vlm/image_rollout.vision_rollout as of 1878fb0: uncompiled sample(), an eval every step, its own masks,
texts and truncation flags), the naive reference. Ids, masks, sampler log-probs, entropies, truncation flags and
texts must be equal (log-probs and entropies to the bit, up to the sign of a masked zero), over seeds,
temperatures 0 and 1, top-p / top-k / min-p, lengths, group sizes and prompts of three lengths, with end tokens
that some rows reach and others not, that every row reaches early (the loop stops before max_new_tokens), or
none."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm")


def reference_vision_rollout(model, prompts, keys, G, params, eos_ids, pad_id, tokenizer):
    """The image rollout's own loop before issue 46 folded it into the one loop (frozen: do not edit)."""
    from mlx_vlm.models.cache import KVCache

    from mlx_grpo.rollout.rollout_records import Rollout
    from mlx_grpo.rollout.sampler import sample

    T, R = params.max_new_tokens, len(prompts) * G
    caches, first, starts = [], [], []
    for ids in prompts:
        inputs = mx.array([ids], dtype=mx.int32)
        positions = model.positions(inputs)  # [3, 1, L]
        cache = [KVCache() for _ in model.layers]
        first.append(model.head(model.hidden(inputs, positions, cache)[:, -1]))  # [1, V]
        caches.append([(c.keys[..., :c.offset, :], c.values[..., :c.offset, :]) for c in cache])
        starts.append(int(positions.max().item()) + 1)  # the next text position after the prompt
    width = max(len(ids) for ids in prompts)
    cache = [KVCache() for _ in model.layers]
    for layer, c in enumerate(cache):  # [R, heads, width, dim]: each prompt's rows, left-padded to width
        parts = [[mx.pad(mx.repeat(kv[layer][j], G, axis=0), [(0, 0), (0, 0), (width - kv[layer][j].shape[2], 0),
                                                                (0, 0)]) for kv in caches] for j in (0, 1)]
        c.keys, c.values, c.offset = mx.concatenate(parts[0]), mx.concatenate(parts[1]), width
    pad = np.repeat([width - len(ids) for ids in prompts], G)
    mask = mx.array(np.arange(width + T)[None] >= pad[:, None])[:, None, None, :]  # [R, 1, 1, width + T]
    start = mx.array(np.repeat(starts, G), dtype=mx.int32)[None, :, None]  # [1, R, 1]
    logits = mx.repeat(mx.concatenate(first), G, axis=0)  # [R, V]
    step_keys = mx.stack([mx.random.split(k, T) for k in keys])  # [R, T, 2]
    alive = np.ones(R, bool)
    toks, lps, ents, masks = [], [], [], []
    for t in range(T):
        tok, lp, ent = sample(logits, step_keys[:, t], params)
        mx.eval(tok, lp, ent)
        tok_np = np.array(tok)
        masks.append(alive.copy())
        toks.append(np.where(alive, tok_np, pad_id))
        lps.append(np.where(alive, np.array(lp), 0.0))
        ents.append(np.where(alive, np.array(ent), 0.0))
        alive &= ~np.isin(tok_np, list(eos_ids))
        if not alive.any() or t == T - 1:
            break
        pos = mx.broadcast_to(start + t, (3, R, 1))
        logits = model.head(model.hidden(tok[:, None].astype(mx.int32), pos, cache, mask)[:, -1])
    completion, mask_np = np.stack(toks, 1), np.stack(masks, 1)
    lengths = mask_np.sum(1)
    ended = np.array([bool(mask_np[r].any()) and int(completion[r, lengths[r] - 1]) in eos_ids for r in range(R)])
    texts = [tokenizer.decode([int(x) for x in completion[r, :lengths[r] - int(ended[r])]]) for r in range(R)]
    return Rollout(prompt_ids=[list(p) for p in prompts], completion_ids=mx.array(completion, dtype=mx.int32),
                   mask=mx.array(mask_np.astype(np.float32)), sampler_logprobs=mx.array(np.stack(lps, 1), dtype=mx.float32),
                   truncated=~ended, texts=texts, group_size=G, entropies=mx.array(np.stack(ents, 1), dtype=mx.float32))


@pytest.fixture(scope="module")
def vlm(tiny_vlm_dir):
    """(model, tokenizer, pad id, the registered ids of three image prompts of three lengths). The text layers'
    weights are scaled 4x: at its random initialisation the tiny VLM decodes greedily one token over and over,
    for every prompt, and greedy rows ending at different steps need rows that differ."""
    from mlx.utils import tree_map

    from mlx_grpo.vlm.image_rollout import encode_vision_prompt
    from mlx_grpo.data.shapes import make_shapes
    from mlx_grpo.commands.vision_eval import load_eval_model

    model, processor, tokenizer, pad_id = load_eval_model(str(tiny_vlm_dir), "float32")
    for layer in model.layers:
        layer.update(tree_map(lambda a: a * 4, layer.parameters()))
    examples = [replace(e, prompt="How many? " + "Look closely. " * (3 * i)) for i, e in
                enumerate(make_shapes(3, seed=5, split="train"))]
    prompts = [encode_vision_prompt(processor, e, "image", "", None, 512) for e in examples]
    assert len({len(p.ids) for p in prompts}) == 3
    return model, tokenizer, pad_id, [model.register(p.ids, p.pixel_values, p.grid_thw) for p in prompts]


def end_tokens(ids: np.ndarray, mode: str) -> set[int]:
    """End tokens for a rollout whose tokens (decoded without any) are ids [R, T]: 'some' a token that about half
    the rows sample (those end there, the rest run to T), 'all' one token of each row before its last column (every
    row ends early, so the loop stops before T), 'none' no end token."""
    R, T = ids.shape
    if mode == "none":
        return set()
    if mode == "all":
        return {int(ids[r, (3 * r) % (T - 1)]) for r in range(R)}
    rows_with = {int(t): sum(int(t) in set(row.tolist()) for row in ids) for t in np.unique(ids)}
    split = [t for t, n in rows_with.items() if 0 < n < R]
    assert split, "no token is sampled by some rows and not others: pick another case"
    return {max(split, key=lambda t: (min(rows_with[t], R - rows_with[t]), -t))}


CASES = [  # (seed, temperature, top_p, top_k, min_p, max_new_tokens, G, prompts, end tokens)
    (0, 0.0, 1.0, 0, 0.0, 8, 2, (0, 1, 2), "some"),
    (1, 1.0, 1.0, 0, 0.0, 10, 3, (0, 1, 2), "some"),
    (2, 1.0, 0.9, 0, 0.0, 7, 2, (2, 0, 1), "all"),
    (3, 1.0, 1.0, 5, 0.0, 12, 2, (0, 1, 2), "some"),
    (4, 1.0, 0.8, 20, 0.0, 5, 2, (1, 2), "none"),
    (5, 0.0, 1.0, 0, 0.0, 6, 1, (2, 1, 0), "all"),
    (6, 1.0, 1.0, 0, 0.05, 9, 4, (1,), "all"),
    (7, 1.0, 0.95, 0, 0.0, 16, 2, (0, 2), "some"),
    (8, 0.0, 1.0, 0, 0.0, 1, 2, (0, 1, 2), "some"),
]


@pytest.mark.parametrize("case", CASES, ids=[f"seed{c[0]}-t{c[1]}-p{c[2]}-k{c[3]}-m{c[4]}-T{c[5]}-G{c[6]}-{c[8]}"
                                             for c in CASES])
def test_vision_rollout_samples_what_its_own_loop_did(vlm, case):
    from mlx_grpo.rollout.rollout_records import SamplingParams
    from mlx_grpo.vlm.image_rollout import vision_rollout

    model, tokenizer, pad_id, all_ids = vlm
    seed, temperature, top_p, top_k, min_p, T, G, which, mode = case
    ids = [all_ids[i] for i in which]
    params = SamplingParams(T, temperature, top_p, top_k, min_p)
    keys = mx.random.split(mx.random.key(seed), len(ids) * G)
    free = reference_vision_rollout(model, ids, keys, G, params, set(), pad_id, tokenizer)
    assert free.completion_ids.shape == (len(ids) * G, T)
    eos = end_tokens(np.array(free.completion_ids), mode)
    want = reference_vision_rollout(model, ids, keys, G, params, eos, pad_id, tokenizer)
    got = vision_rollout(model, ids, keys, G, params, eos, pad_id, tokenizer)

    # the case covers what it says
    if mode == "some" and T > 1:
        assert want.truncated.any() and not want.truncated.all()
    if mode == "all":
        assert not want.truncated.any() and want.completion_ids.shape[1] < T
    if mode == "none":
        assert want.truncated.all()

    assert got.completion_ids.shape == want.completion_ids.shape
    assert got.completion_ids.dtype == want.completion_ids.dtype == mx.int32
    np.testing.assert_array_equal(np.array(got.completion_ids), np.array(want.completion_ids))
    np.testing.assert_array_equal(np.array(got.mask), np.array(want.mask))
    assert got.mask.dtype == want.mask.dtype == mx.float32
    np.testing.assert_array_equal(got.truncated, want.truncated)
    assert got.texts == want.texts
    assert got.prompt_ids == want.prompt_ids and got.group_size == want.group_size == G
    for name in ("sampler_logprobs", "entropies"):
        a, b = np.array(getattr(got, name)), np.array(getattr(want, name))
        assert a.dtype == b.dtype == np.float32
        # to the bit, but for the sign of zero: a masked column is 0.0 in the old loop, lp * 0 = -0.0 in finish_rollout
        np.testing.assert_array_equal((a + 0.0).view(np.uint32), (b + 0.0).view(np.uint32), err_msg=name)
