"""Tool turns that keep their place (rollout/turns.py): a row whose turn ended at a tool call resumes on its
kept KV cache, only the tool's answer (and the turn's last token) prefilled on top of it
(decoder.prefill_after). Same tokens and log-probs as prefilling the whole context again, fewer tokens
prefilled, and each row still gets what it gets decoded alone."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from caller_model import CALLER, write_caller_model
from conftest import begin_widths
from mlx_grpo.models import decoder
from mlx_grpo.models.model_loading import load_model
from mlx_grpo.rollout.copy_decoder import CopyDecoder, placed
from mlx_grpo.rollout.engine import RolloutEngine
from mlx_grpo.rollout.multiturn import MultiTurn
from mlx_grpo.rollout.rollout_records import SamplingParams
from mlx_grpo.rollout.turns import Kept, prefill_resumed
from mlx_grpo.tools.calls import NanochatFormat
from mlx_grpo.tools.environments import ToolEnvironment


@pytest.fixture(scope="module")
def attending(tmp_path_factory):
    """write_caller_model's bigram llama that calls the calculator, given a second layer and small attention
    and MLP outputs: it still calls the tool (a varying number of times, or answers at once), but every
    logit now depends on the keys and values of its whole context, through both layers."""
    from mlx_lm.models import llama

    path = write_caller_model(tmp_path_factory.mktemp("attending") / "model", CALLER)
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = 2
    shapes = dict(tree_flatten(llama.Model(llama.ModelArgs.from_dict(config)).parameters()))
    # layer 1's weights from keys of their own, not MLX's global generator: a thread an earlier test left running
    # could draw from it in between (under xdist a worker's files come in any order)
    fresh = {k: v if "norm" in k else mx.random.uniform(-1, 1, v.shape, key=mx.random.key(1000 + i)) / v.shape[-1] ** .5
             for i, (k, v) in enumerate(sorted(shapes.items()))}
    params = {**fresh, **mx.load(str(path / "model.safetensors"))}  # embedding, head, layer 0: the caller's
    for i, k in enumerate(sorted(params)):
        if k.endswith("o_proj.weight") or k.endswith("down_proj.weight"):
            params[k] = 0.01 * mx.random.normal(params[k].shape, key=mx.random.key(i))
    mx.save_safetensors(str(path / "model.safetensors"), params)
    (path / "config.json").write_text(json.dumps(config))
    return load_model(str(path), "float32")


def _episodes(model, tok, keep: bool, n_prompts: int = 6, G: int = 4, sync_every: int = 4, graph: bool = False,
              T: int = 64, jobs_of: int = 3, running: int = 0, lookahead: int = 0):
    """Two (or more) batch steps of n_prompts prompts x G rows: the later steps' prompts refill freed slots
    (running: running_rows, the batch's first rows; lookahead: the engine's). -> (rollouts, the engine)."""
    fmt = NanochatFormat(tok)
    multiturn = MultiTurn(ToolEnvironment(["calculator"], fmt, max_turns=4), fmt, tok)
    rows = [{"prompt": f"q{i}", "answer": "5"} for i in range(n_prompts)]
    prompts = [multiturn.encode(r, "", "", 256)[0] for r in rows]
    keys = mx.random.split(mx.random.key(3), n_prompts * G)
    jobs = [(prompts[j:j + jobs_of], keys[j * G:(j + jobs_of) * G], rows[j:j + jobs_of])
            for j in range(0, n_prompts, jobs_of)]
    engine = RolloutEngine(tok, mode="copy", sync_every=sync_every, graph=graph, keep_turn_cache=keep,
                           rows=running, lookahead=lookahead).refresh(model)
    return multiturn.generate_many(engine, jobs, G, SamplingParams(T, 1.0)), engine


def test_refills_prefill_and_sample_a_power_of_two_of_rows(attending, monkeypatch):
    """Every prefill of a tool rollout on the copy (its first rows, later prompts, next turns on their kept
    blocks), on a bucketed timeline, and every first sampling of admitted rows runs on a power of two of rows
    (models.forward.row_bucket),
    the first row repeated and dropped after: on CUDA, cuDNN's attention builds a graph per new shape (~90 ms,
    bench/admit_shapes.py), and a trainer's refills meet new row counts every update. The rows' tokens are the
    whole prefill's (test_rows_resumed_on_their_cache_sample_what_a_whole_prefill_gives)."""
    from mlx_grpo.rollout import loop

    model, tok = attending
    prefilled, sampled, widths = [], [], []
    for name in ("prefill", "prefill_after"):
        def spy(spec, w, tokens, *rest, original=getattr(decoder, name)):
            prefilled.append(tokens.shape[0])
            # the past's timeline, or the prompts'
            widths.append(rest[1].shape[3] if len(rest) > 1 else tokens.shape[1])
            return original(spec, w, tokens, *rest)
        monkeypatch.setattr(decoder, name, spy)

    def sample_rows(sampler, logits, *rest, original=loop.sample_rows):
        def recorded(lg, *rest):
            sampled.append((logits.shape[0], lg.shape[0]))
            return sampler(lg, *rest)
        return original(recorded, logits, *rest)
    monkeypatch.setattr(loop, "sample_rows", sample_rows)
    _episodes(model, tok, True, n_prompts=6, G=3, jobs_of=3)
    assert any(n & (n - 1) for n, _ in sampled)  # admissions of other sizes than a power of two happened
    assert all(rows & (rows - 1) == 0 for rows in prefilled) and len(prefilled) > 3
    assert all(width % 64 == 0 for width in widths)  # bucketed timelines, whatever slot the batch is at
    assert all(padded & (padded - 1) == 0 and n <= padded < 2 * n for n, padded in sampled)


def _calls(outs) -> list[int]:
    return [sum(t.origin == "tool" for t in tr.turns) for out in outs for tr in out.transcripts]


@pytest.mark.parametrize("sync_every,graph,rows", [(4, False, 0), (2, False, 0), (8, False, 0), (4, True, 0),
                                                   (4, False, 24), (8, True, 16)])
def test_rows_resumed_on_their_cache_sample_what_a_whole_prefill_gives(attending, sync_every, graph, rows,
                                                                      monkeypatch):
    """rows: the batch's first rows (running_rows; 0: the first step's 12); the re-prefill path always
    starts from one step's, so the two also differ in which rows share a batch."""
    model, tok = attending
    began = begin_widths(monkeypatch)
    kept, _ = _episodes(model, tok, True, sync_every=sync_every, graph=graph, running=rows)
    whole, _ = _episodes(model, tok, False, sync_every=sync_every, graph=graph)
    assert began == [rows or 12, 12]
    calls = _calls(kept)
    # the cases this is for: rows calling twice or more, rows answering at once, two batch steps (refill)
    assert sum(c >= 2 for c in calls) >= 3 and 0 in calls and len(kept) == 2
    for a, b in zip(kept, whole):
        assert a.texts == b.texts
        assert a.completion_ids.tolist() == b.completion_ids.tolist() and a.mask.tolist() == b.mask.tolist()
        assert a.extents.tolist() == b.extents.tolist() and a.truncated.tolist() == b.truncated.tolist()
        np.testing.assert_allclose(np.array(a.sampler_logprobs), np.array(b.sampler_logprobs), atol=1e-5)
        np.testing.assert_allclose(np.array(a.entropies), np.array(b.entropies), atol=1e-4)
    # the attention matters: a token drawn at 0.8 by the bigram is drawn at another probability here
    drawn = np.array(kept[0].sampler_logprobs)[np.array(kept[0].sampler_logprobs) < -0.01]
    assert np.abs(drawn - np.log(0.8)).min() > 1e-4


def test_prefill_after_a_prefix_is_the_whole_prefill(tiny_model_dir):
    """prefill(prefix + chunk) == prefill(prefix), then prefill_after(chunk) on its keys: last logits and every
    layer's keys and values, rows of different prefix and chunk lengths (left padding on both)."""
    model, _ = load_model(str(tiny_model_dir), "float32")
    spec, w = decoder.build(model, mx.float32)
    rng = np.random.default_rng(0)
    prefixes = [[int(t) for t in rng.integers(3, 200, n)] for n in (5, 12, 1, 9)]
    chunks = [[int(t) for t in rng.integers(3, 200, n)] for n in (3, 1, 7, 2)]

    def left_padded(seqs, width):
        return (mx.array([[0] * (width - len(s)) + s for s in seqs], dtype=mx.int32),
                mx.array([width - len(s) for s in seqs], dtype=mx.int32))

    full = [p + c for p, c in zip(prefixes, chunks)]
    want_logits, want_k, want_v = decoder.prefill(spec, w, *left_padded(full, 24))
    _, past_k, past_v = decoder.prefill(spec, w, *left_padded(prefixes, 14))
    W, C = 26, 8  # a timeline wider than any context; chunks padded to C
    k_line = np.zeros((len(w["layers"]), 4, spec.kv_heads, W, spec.head_dim), np.float32)
    v_line = k_line.copy()
    for r, (p, c) in enumerate(zip(prefixes, chunks)):  # each past right before its chunk, at the timeline's end
        k_line[:, r, :, W - len(c) - len(p):W - len(c)] = np.array(mx.stack(past_k)[:, r, :, 14 - len(p):])
        v_line[:, r, :, W - len(c) - len(p):W - len(c)] = np.array(mx.stack(past_v)[:, r, :, 14 - len(p):])
    start = mx.array([W - len(f) for f in full], dtype=mx.int32)
    logits, keys, values = decoder.prefill_after(spec, w, *left_padded(chunks, C), mx.array(k_line),
                                                 mx.array(v_line), start)
    np.testing.assert_allclose(np.array(logits), np.array(want_logits), atol=1e-5)
    for r, f in enumerate(full):
        for got, want in ((keys, want_k), (values, want_v)):
            np.testing.assert_allclose(np.array(got[:, r, :, W - len(f):]),
                                       np.array(mx.stack(want)[:, r, :, 24 - len(f):]), atol=1e-5)
    # and the engine's placement: the contexts' cache ends at slot `at`, as a whole prefill lays it out
    engine = RolloutEngine(None, mode="copy").refresh(model)
    at = 40
    copy = CopyDecoder(engine.spec, engine.weights, None, False, 0)
    whole_k, whole_v, whole_start, whole_logits = copy.prefill(full, [1] * 4, at)
    kept = [(np.array(mx.stack(past_k)[:, r, :, 14 - len(p):]), np.array(mx.stack(past_v)[:, r, :, 14 - len(p):]))
            for r, p in enumerate(prefixes)]
    got_k, got_v, got_start, got_logits, prefilled = prefill_resumed(
        spec, w, [(f, Kept.of(mx.array(k), mx.array(v))) for f, (k, v) in zip(full, kept)], at, 0)
    assert prefilled == sum(len(c) for c in chunks) and got_start.tolist() == whole_start.tolist()
    np.testing.assert_allclose(np.array(got_logits), np.array(whole_logits), atol=1e-5)
    assert got_k.shape == whole_k.shape  # the same W slots, ending at `at`
    for r, f in enumerate(full):  # the slots a row attends (a whole prefill leaves its pads' keys before them)
        for got, want in ((got_k, whole_k), (got_v, whole_v)):
            np.testing.assert_allclose(np.array(got[:, r, :, -len(f):]), np.array(want[:, r, :, -len(f):]), atol=1e-5)


def test_kept_caches_prefill_only_the_answers(attending):
    """The tokens prefilled, counted by the engine, are exactly the prompts (once per group) plus, for each
    later turn, the tool's answer and the turn's last token; the whole context each time without the cache."""
    model, tok = attending
    (kept, engine), (whole, whole_engine) = (_episodes(model, tok, keep) for keep in (True, False))
    assert kept[0].completion_ids.tolist() == whole[0].completion_ids.tolist()
    prompts = sum(len(p) for out in kept for p in out.prompt_ids)
    answers = contexts = 0
    for out in kept:
        for r in range(len(out.texts)):
            mask = out.mask[r, :int(out.extents[r])].tolist()
            for i in range(1, len(mask)):  # a later turn starts where fed tokens give way to sampled ones
                if mask[i] == 1 and mask[i - 1] == 0:
                    j = i - 1
                    while mask[j] == 0:
                        j -= 1
                    answers += i - j  # the fed tokens and the sampled token before them
                    contexts += len(out.row_prompts[r]) + i
    assert answers > 0
    assert engine.prefilled_tokens == prompts + answers
    assert whole_engine.prefilled_tokens == prompts + contexts
    assert engine.prefilled_tokens < whole_engine.prefilled_tokens / 3


def test_rows_resumed_on_their_cache_match_each_row_alone(attending):
    """Which rows share the batch (and where the syncs fall for a row) leaves a resumed row's tokens as they are."""
    model, tok = attending
    together, _ = _episodes(model, tok, True, n_prompts=4, jobs_of=2, sync_every=2)
    fmt = NanochatFormat(tok)
    multiturn = MultiTurn(ToolEnvironment(["calculator"], fmt, max_turns=4), fmt, tok)
    engine = RolloutEngine(tok, mode="copy", sync_every=2).refresh(model)
    keys = mx.random.split(mx.random.key(3), 16)
    rows = [{"prompt": f"q{i}", "answer": "5"} for i in range(4)]
    checked = 0
    for j, out in enumerate(together):
        for r in range(8):
            if sum(t.origin == "tool" for t in out.transcripts[r].turns) < 2 and r % 3:
                continue  # every row with 2+ calls, some others
            p, k = j * 2 + r // 4, j * 8 + r
            alone = multiturn.generate_many(engine, [([out.prompt_ids[r // 4]], keys[k:k + 1], [rows[p]])], 1,
                                            SamplingParams(64, 1.0))[0]
            n = int(out.extents[r])
            assert int(alone.extents[0]) == n and alone.texts[0] == out.texts[r]
            assert alone.completion_ids[0, :n].tolist() == out.completion_ids[r, :n].tolist()
            np.testing.assert_allclose(np.array(alone.sampler_logprobs[0, :n]), np.array(out.sampler_logprobs[r, :n]),
                                       atol=2e-5)
            checked += 1
    assert checked >= 4


def test_kept_blocks_are_released_once_their_rows_are_in_the_batch(attending, monkeypatch):
    """A kept block is a copy of its row's cache: once the refill has put it in the batch, the queue entry must
    let it go, or every resumed turn's context stays in memory until the rollout ends."""
    from mlx_grpo.rollout import turns as turns_mod

    seen, original = [], turns_mod.TurnRows.take

    def take(self, entries, *args, **kwargs):
        seen.append(entries)
        return original(self, entries, *args, **kwargs)

    monkeypatch.setattr(turns_mod.TurnRows, "take", take)
    (outs, engine) = _episodes(*attending, True)
    assert max(_calls(outs)) >= 2 and seen
    entries = seen[-1]
    assert any(len(e) == 4 for e in entries)  # later turns were queued with a block slot
    assert all(e[3] is None for e in entries if len(e) == 4)


def test_no_kept_block_outlives_its_admission(attending, monkeypatch):
    """Nothing else holds a kept block once its row is in the batch either (the loop's own reference to the
    entries it admitted once did, till the next refill: a block holds every row reported at its sync)."""
    import gc
    import weakref

    from mlx_grpo.rollout import turns as turns_mod

    taken, queued, worst = [], [None], [0]
    take, report = turns_mod.TurnRows.take, turns_mod.TurnRows.report

    def taking(self, entries, *args, **kwargs):
        queued[0], before = entries, len(entries)
        out = take(self, entries, *args, **kwargs)
        taken.extend(weakref.ref(e[3]) for e in entries[before:] if e[3] is not None)
        return out

    def reporting(self, *args, **kwargs):
        gc.collect()
        waiting = {id(e[3]) for e in queued[0] or [] if e[3] is not None}
        worst[0] = max(worst[0], sum(r() is not None and id(r()) not in waiting for r in taken))
        return report(self, *args, **kwargs)

    monkeypatch.setattr(turns_mod.TurnRows, "take", taking)
    monkeypatch.setattr(turns_mod.TurnRows, "report", reporting)
    (outs, engine) = _episodes(*attending, True)
    assert max(_calls(outs)) >= 2 and len(taken) >= 4
    assert worst[0] == 0


@pytest.mark.parametrize("sync_every,lookahead", [(2, 0), (4, 3)])
def test_rows_kept_between_syncs_equal_a_whole_assembly(attending, monkeypatch, sync_every, lookahead):
    """columns.Written converts only the columns decoded since the last sync; at every sync of a tool-calling
    decode (rows added by later turns, batches rebuilt by refill and compaction) its rows equal assembling
    every segment again, the open one without the columns a lookahead holds back, and the rollouts equal the
    re-prefill path's."""
    from mlx_grpo.rollout import columns

    checked, update = [], columns.Written.update

    def compared(self, segments, join, n_rows, hold=0):
        got = update(self, segments, join, n_rows, hold)
        *closed, (rows, first, parts) = segments
        seen = closed + [(rows, first, tuple(p[:len(p) - hold] for p in parts))]
        want = columns.assemble(seen, join, n_rows, self.T, -1)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
        checked.append((n_rows, hold))
        return got

    monkeypatch.setattr(columns.Written, "update", compared)
    outs, _ = _episodes(*attending, True, sync_every=sync_every, lookahead=lookahead)
    assert len(checked) > 10 and checked[-1][0] > checked[0][0]  # many syncs, rows added by later turns
    assert lookahead in {hold for _, hold in checked} <= {0, lookahead}  # the syncs held columns back
    assert max(_calls(outs)) >= 2


def test_a_refill_copies_the_cache_one_half_at_a_time(tiny_model_dir):
    """CopyDecoder.admit appends rows with one copy of the cache, the keys' copy made (and the old keys let go)
    before the values are copied: the refill's peak stays near 1.5x the cache, where copying both at once
    held 2x (a large batch's refill is what ran out of device memory with tools)."""
    model, _ = load_model(str(tiny_model_dir), "float32")
    engine = RolloutEngine(None, mode="copy").refresh(model)
    spec = engine.spec
    copy = CopyDecoder(spec, engine.weights, None, False, 0)
    copy.idx, slots, capacity = 8, 4096, 64  # a cache much larger than the row the refill adds
    shape = (len(engine.weights["layers"]), slots, spec.kv_heads, capacity, spec.head_dim)
    copy.keys, copy.values = mx.zeros(shape), mx.zeros(shape)
    copy.start = mx.zeros((slots,), dtype=mx.int32)
    mx.eval(copy.keys, copy.values, copy.start)
    cache = 2 * copy.keys.nbytes
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    logits, rows = copy.admit([([1, 2, 3], 0, 1, None)], T=capacity - copy.idx)
    peak = mx.get_peak_memory() - before
    assert copy.keys.shape[1] == slots + 1 and rows.tolist() == [0] and logits.shape[0] == 1
    assert peak < 0.6 * cache, f"the refill held {peak / cache:.2f}x the cache beside it"


def test_the_first_batch_is_its_cache_and_no_more(tiny_model_dir):
    """CopyDecoder.begin gathers each prompt's prefilled block (at the cache's capacity) into its G rows, with no
    rows x W block beside the cache: its peak stays within 10% of the cache it makes (one prompt's block per 64
    rows here)."""
    model, _ = load_model(str(tiny_model_dir), "float32")
    engine = RolloutEngine(None, mode="copy").refresh(model)
    copy = CopyDecoder(engine.spec, engine.weights, None, False, 0)
    contexts = [[1 + (i + j) % 50 for j in range(100 + i)] for i in range(8)]
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    logits = copy.begin(contexts, [64] * 8, 256)
    mx.synchronize()
    cache = copy.keys.nbytes + copy.values.nbytes
    assert copy.keys.shape[1] == 512 and logits.shape[0] == 512 and copy.start.shape == (512,)
    assert mx.get_peak_memory() - before < 1.1 * cache, f"{(mx.get_peak_memory() - before) / cache:.2f}x the cache"


def placed_reference(cache: np.ndarray, blocks: list, capacity: int) -> np.ndarray:
    """What placed computes when it appends: the cache padded with zeros to `capacity` slots, then each block
    [layers, n, Hkv, W, Dh] (W <= capacity) padded to end at its slot + W and concatenated as rows."""
    grown = np.pad(cache, [(0, 0), (0, 0), (0, 0), (0, capacity - cache.shape[3]), (0, 0)])
    rows = [np.pad(b, [(0, 0), (0, 0), (0, 0), (slot, capacity - slot - b.shape[3]), (0, 0)]) for b, slot in blocks]
    return np.concatenate([grown] + rows, axis=1)


def test_placed_appends_rows_and_slots_as_pad_and_concatenate():
    """CopyDecoder's new caches (placed): the old cache at its rows and slots, the admitted rows' blocks after
    it, each ending where its slots say, zeros elsewhere: numpy's pad and concatenate."""
    rng = np.random.default_rng(0)
    cache = rng.normal(size=(2, 5, 3, 12, 4)).astype(np.float32)
    blocks = [(rng.normal(size=(2, 2, 3, 7, 4)).astype(np.float32), 9), (rng.normal(size=(2, 3, 3, 16, 4))
                                                                          .astype(np.float32), 4)]
    got = placed((2, 10, 3, 20, 4), [(mx.array(cache), 0, 0)] + [(mx.array(b), 5 + 2 * i, s)
                                                                 for i, (b, s) in enumerate(blocks)])
    np.testing.assert_array_equal(np.array(got), placed_reference(cache, blocks, 20))


@pytest.mark.gpu
@pytest.mark.parametrize("rows, slots, capacity", [(1024, 512, 512), (768, 448, 512)])
def test_placed_is_exact_past_two_to_the_31_elements(rows, slots, capacity):
    """On CUDA, a cache over 2^31 elements (30 layers x 3 heads x 64 dims: 1,024 rows x 512 slots, or 768 x 448
    grown to 512 slots, which crosses 2^31) with 8 rows appended: in every layer, the appended rows and old rows
    at both ends and the middle exactly as pad and concatenate place them. MLX 0.32.4's own mx.concatenate got the
    appended rows wrong in the layers that start past element 2^31. The arrays are built on the device and only
    the checked rows come back (the whole cache through numpy took minutes)."""
    L, H, D, n = 30, 3, 64, 8

    def pattern(layer, R, S, xp):  # small integers, exact in bfloat16, distinct across nearby rows and slots
        # R: a row count, or the row numbers themselves (numpy builds only the rows checked)
        r, h, s, d = ((xp.arange(k) if isinstance(k, int) else xp.array(k)).reshape([-1 if i == j else 1
                                                                                      for j in range(4)])
                      for i, k in enumerate((R, H, S, D)))
        return (layer * 7 + r * 13 + h * 3 + s * 5 + d) % 97

    cache = mx.stack([pattern(layer, rows, slots, mx).astype(mx.bfloat16) for layer in range(L)])
    block = mx.stack([pattern(layer + 1, n, 40, mx).astype(mx.bfloat16) for layer in range(L)])
    got = placed((L, rows + n, H, capacity, D), [(cache, 0, 0), (block, rows, capacity - 40)])
    mx.eval(got)
    del cache, block
    old = [0, 1, rows // 2, rows - 2, rows - 1]
    checked = mx.array(old + list(range(rows, rows + n)))
    for layer in range(L):
        want = np.zeros((len(old) + n, H, capacity, D), np.float32)
        want[:len(old), :, :slots] = pattern(layer, old, slots, np)
        want[len(old):, :, capacity - 40:] = pattern(layer + 1, n, 40, np)
        np.testing.assert_array_equal(np.array(got[layer][checked].astype(mx.float32)), want,
                                      err_msg=f"layer {layer}")


def test_a_rebuilt_refill_places_fresh_and_resumed_rows_after_the_batch(tiny_model_dir):
    """CopyDecoder.admit with a fresh prompt's rows and a next turn on its kept block: the new cache is the old
    one grown to the capacity, then the fresh rows, then the resumed row, each block ending at the current slot,
    as numpy's pad and concatenate place the blocks prefill and prefill_resumed give on their own; start
    likewise."""
    from mlx_grpo.models.forward import bucket

    model, _ = load_model(str(tiny_model_dir), "float32")
    engine = RolloutEngine(None, mode="copy").refresh(model)
    spec = engine.spec
    copy = CopyDecoder(spec, engine.weights, None, False, 0)
    copy.begin([[3, 4, 5, 6, 7], [8, 9, 10]], [2, 2], 24)
    copy.idx += 30  # 30 decode steps on (their slots' contents do not matter here): the refill must grow the cache
    old_k, old_v, old_start = (np.array(a) for a in (copy.keys, copy.values, copy.start))
    rng = np.random.default_rng(3)
    layers = len(engine.weights["layers"])
    past = [mx.array(rng.normal(size=(layers, spec.kv_heads, 6, spec.head_dim)).astype(np.float32)) for _ in "kv"]
    fresh, resumed = [11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 23, 24, 25, 26, 27, 28]  # resumed[:6] kept
    T, idx = 24, copy.idx
    logits, rows = copy.admit([(fresh, 4, 2, None), (resumed, 6, 1, Kept.of(*past))], T)
    alone = CopyDecoder(spec, engine.weights, None, False, 0)
    f_k, f_v, f_start, f_logits = alone.prefill([fresh], [2], idx)
    r_k, r_v, r_start, r_logits, _ = prefill_resumed(spec, alone.prefill_weights, [(resumed, Kept.of(*past))], idx, 0)
    capacity = max(old_k.shape[3], bucket(idx + T))
    assert capacity > old_k.shape[3] and rows.tolist() == [4, 5, 6]
    for got, old, parts in ((copy.keys, old_k, (f_k, r_k)), (copy.values, old_v, (f_v, r_v))):
        want = placed_reference(old, [(np.array(p), idx - p.shape[3]) for p in parts], capacity)
        np.testing.assert_array_equal(np.array(got), want)
    assert np.array(copy.start).tolist() == old_start.tolist() + np.array(f_start).tolist() + np.array(r_start).tolist()
    np.testing.assert_array_equal(np.array(logits), np.concatenate([np.array(f_logits), np.array(r_logits)]))
