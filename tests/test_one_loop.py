"""One decode loop for text (issue 46): the engine's sampling copy (refills, compaction, decode_graph, kept turn
blocks) and the model path (mlx-lm's caches, the static cache) decode through rollout/loop.decode_rows and sample
exactly what their two loops sampled before they were made one. `frozen_generate_many` below is a frozen copy of
those two loops as RolloutEngine.generate_many ran them (the fused loop, its prefill and refill; decode.py's
decode_loop): tokens, log-probs, entropies, masks, texts, the counters and the callbacks' calls are compared to the
bit, on the copy and the model, with stop strings, limits, refills and tool turns. Image rollouts have their own
frozen reference (tests/test_vision_loop.py)."""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import numpy as np
import pytest

from caller_model import CALLER, write_caller_model
from mlx_grpo.models import compiled_decode, decoder
from mlx_grpo.models.forward import bucket
from mlx_grpo.models.kernel_forward import decode_step, serves as kernel_serves
from mlx_grpo.models.model_loading import load_model
from mlx_grpo.models.tiny import write_tiny_family
from mlx_grpo.rollout import decode
from mlx_grpo.rollout.columns import StopRows, Written, assemble
from mlx_grpo.rollout.copy_decoder import CopyDecoder
from mlx_grpo.rollout.engine import RolloutEngine
from mlx_grpo.rollout.multiturn import MultiTurn
from mlx_grpo.rollout.rollout_records import SamplingParams
from mlx_grpo.rollout.sampler import StopScanner, end_ids, finish_rollout, make_sampler
from mlx_grpo.rollout.turns import TurnRows, prefill_resumed
from mlx_grpo.tools.calls import NanochatFormat
from mlx_grpo.tools.environments import ToolEnvironment


# ---------------------------------------------------------------- the two loops before issue 46 made them one
# (frozen: do not edit)
MIN_ROWS = 8


def frozen_generate_many(engine, jobs, group_size, params, prefill_text="", on_stop=None, limits=None, turns=None,
                         on_done=None):
    if not engine.uses_copy:
        out, first = [], 0
        for prompts, keys in jobs:
            n = len(prompts) * group_size
            watch = None if on_stop is None else (lambda r, ids, first=first: on_stop(first + r, ids))
            progress = None if on_done is None else partial(on_done, first)
            out.append(frozen_generate_rollout(engine.model, engine.tokenizer, prompts, group_size, params, keys,
                                               prefill_text, sync_every=engine.sync_every, on_stop=watch,
                                               limits=None if limits is None else limits[first:first + n],
                                               on_done=progress))
            first += n
        return out
    return _frozen_fused(engine, jobs, group_size, params, prefill_text, on_stop, turns, limits, on_done)


def frozen_generate_rollout(model, tokenizer, prompts, group_size, params, key, prefill_text="", sync_every=8,
                            static_cache=None, attention_kernel=True, on_stop=None, limits=None, on_done=None):
    eos_ids, pad_id = end_ids(tokenizer, params)
    eos = mx.array(eos_ids or [-1], dtype=mx.int32)
    logits, caches = decode._prefill(model, prompts, pad_id)
    logits = mx.repeat(logits, group_size, axis=0)
    row_keys = key if key.ndim == 2 else mx.random.split(key, logits.shape[0])
    plain_caches = decode.supports_static_cache(model)
    kernel = plain_caches and attention_kernel and kernel_serves(model, caches[0].keys.shape[-1])
    static = plain_caches and (kernel if static_cache is None else static_cache)
    use_kernel = static and kernel
    if static:
        caches = decode._static_caches(caches, group_size, caches[0]._idx + params.max_new_tokens, use_kernel)
    else:
        decode._repeat_caches(caches, group_size)
    forward = partial(decode_step, model) if use_kernel else model
    ids, lps, ents = _frozen_decode_loop(forward, caches, logits, row_keys, params, eos, tokenizer, sync_every,
                                         on_stop, limits, on_done)
    return finish_rollout(tokenizer, prompts, ids, lps, ents, eos_ids, pad_id, params, group_size, prefill_text)


def _frozen_decode_loop(forward, caches, logits, row_keys, params, eos, tokenizer, sync_every, on_stop=None,
                        limits=None, on_done=None):
    keys = mx.vmap(lambda k: mx.random.split(k, params.max_new_tokens))(row_keys)
    sampler = make_sampler(params, eos)
    scanner = StopScanner(tokenizer, params.stop)
    token, logprob, entropy, ended = sampler(logits, keys[:, 0], mx.zeros((logits.shape[0],), dtype=mx.bool_))
    tokens, logprobs, entropies = [token], [logprob], [entropy]
    for step in range(1, params.max_new_tokens):
        if step % sync_every == 0:
            mx.eval(ended)
            done = np.array(ended) if limits is None else np.array(ended) | (step >= np.asarray(limits))
            if on_done is not None:
                on_done(done)
            if done.all() or (params.stop and _frozen_all_stopped(scanner, tokens, done, on_stop)):
                break
        logits = forward(token[:, None], cache=caches)[:, -1, :]
        token, logprob, entropy, ended = sampler(logits, keys[:, step], ended)
        tokens.append(token)
        logprobs.append(logprob)
        entropies.append(entropy)
        mx.async_eval(token, logprob, entropy, ended)
    ids, lps, ents = mx.stack(tokens, axis=1), mx.stack(logprobs, axis=1), mx.stack(entropies, axis=1)
    mx.eval(ids, lps, ents)
    return ids, lps, ents


def _frozen_all_stopped(scanner, tokens, ended, on_stop=None):
    ids = mx.stack(tokens, axis=1).tolist()
    if on_stop is None:
        return all(done or scanner.cut(r, row) is not None for r, (row, done) in enumerate(zip(ids, ended.tolist())))
    stopped = True
    for r, (row, done) in enumerate(zip(ids, ended.tolist())):
        cut = None if done else scanner.cut(r, row)
        if cut is not None:
            on_stop(r, row[:cut])
        stopped = stopped and (done or cut is not None)
    return stopped


def _frozen_prefill_weights(engine):
    return compiled_decode.model_layout(engine.weights) if engine.graph else engine.weights


def _frozen_prefill(engine, contexts, counts, at, capacity, pad_id):
    spec, weights = engine.spec, _frozen_prefill_weights(engine)
    engine.prefilled_tokens += sum(len(c) for c in contexts)
    longest = max(len(c) for c in contexts)
    width = max(longest, min(bucket(longest), at))
    padding = mx.array([width - len(c) for c in contexts], dtype=mx.int32)
    tokens = mx.array([[pad_id] * (width - len(c)) + list(c) for c in contexts], dtype=mx.int32)
    logits, keys, values = decoder.prefill(spec, weights, tokens, padding)
    slots = [(0, 0), (0, 0), (0, 0), (at - width, capacity - at), (0, 0)]
    repeat = mx.array(np.repeat(np.arange(len(contexts)), counts))
    keys = mx.pad(mx.stack(keys), slots)[:, repeat]
    values = mx.pad(mx.stack(values), slots)[:, repeat]
    mx.eval(keys, values)
    return keys, values, (padding + (at - width))[repeat], logits[repeat]


def _frozen_fused(self, jobs, G, params, prefill_text, on_stop=None, turns=None, limits=None, on_done=None):
    tokenizer, (spec, weights) = self.tokenizer, self._current()
    eos_ids, pad_id = end_ids(tokenizer, params)
    T = params.max_new_tokens
    sampler = make_sampler(params, mx.array(eos_ids or [-1], dtype=mx.int32))
    step = self.step_fn(params, tuple(eos_ids), decoder.kernel_serves(spec))
    stops = StopRows(tokenizer, params.stop)
    entries = [(p, g * G, G, None) for g, p in enumerate(p for job, _ in jobs for p in job)]
    n_rows = len(entries) * G
    state = None if turns is None else TurnRows(turns, self.keep_turn_cache, [len(e[0]) for e in entries], G)
    all_keys = mx.concatenate([mx.vmap(lambda k: mx.random.split(k, T))(keys) for _, keys in jobs])
    join = np.zeros(n_rows, dtype=np.int64)
    limit = np.full(n_rows, T, dtype=np.int64) if limits is None else np.minimum(np.asarray(limits), T)
    reported = np.zeros(n_rows, dtype=bool)
    finished = np.zeros(n_rows, dtype=bool)
    queue = list(range(len(jobs[0][0]), len(entries)))
    first = list(range(len(jobs[0][0])))
    idx = bucket(max(len(entries[e][0]) for e in first))
    self.prefilled_tokens = 0
    keys, values, start, logits = _frozen_prefill(self, [entries[e][0] for e in first], [G] * len(first), idx,
                                                  idx + T, pad_id)
    rows = np.arange(len(first) * G)
    target = len(rows)
    token, logprob, entropy, ended = sampler(logits, all_keys[mx.array(rows), 0], mx.zeros((len(rows),), mx.bool_))
    kstep = mx.ones((len(rows),), dtype=mx.int32)
    segments, columns, opened = [], ([token], [logprob], [entropy]), 0
    rows_so_far = Written(T)
    self.row_steps, self.steps = len(rows), 0
    s, last = 1, T
    slot_rows, slot, slot_at = None, None, -1
    while s < last or queue or (turns is not None and (turns.pending() or not reported.all())):
        if s % self.sync_every == 0 or s >= last:
            mx.eval(ended)
            if turns is not None:
                n_rows, all_keys, join, limit, reported = state.take(entries, queue, n_rows, T, all_keys, join,
                                                                     limit, reported)
            done = np.array(ended) | (rows < 0) | (s - join[np.maximum(rows, 0)] >= limit[np.maximum(rows, 0)])
            written = rows_so_far.update(segments + [(rows, opened, columns)], join, n_rows) \
                if params.stop or turns is not None else None
            if params.stop:
                done |= stops.stopped(written[0], written[3], rows, on_stop)
            if on_done is not None:
                finished[rows[done & (rows >= 0)]] = True
                on_done(0, finished)
            if turns is not None:
                state.report(written, rows, done, reported, keys, values, start)
                if done.all() and not queue and turns.pending():
                    n_rows, all_keys, join, limit, reported = state.take(entries, queue, n_rows, T, all_keys,
                                                                         join, limit, reported)
            if done.all() and not queue:
                break
            live = np.flatnonzero(~done)
            admit = []
            if queue and not len(live) and len(entries[queue[0]][0]) > idx:
                idx = bucket(len(entries[queue[0]][0]))
            wanted = max(G, target // 4) if queue and entries[queue[0]][2] > 1 else max(1, target // 8)
            if queue and (target - len(live) >= wanted or not len(live)):
                free = target - len(live)
                while queue and entries[queue[0]][2] <= free and len(entries[queue[0]][0]) <= idx:
                    free -= entries[queue[0]][2]
                    admit.append(queue.pop(0))
            if admit or (self.compact and len(rows) > MIN_ROWS and len(live) <= len(rows) // 2):
                segments.append((rows, opened, columns))
                opened, columns = s, ([], [], [])
                size = len(live) + sum(entries[e][2] for e in admit)
                fill = max(MIN_ROWS, 1 << int(np.ceil(np.log2(max(size, 1))))) - size
                spare = np.flatnonzero(done)
                keep = np.concatenate([live, spare[:fill], np.zeros(max(0, fill - len(spare)), np.int64)])
                new_rows = np.concatenate([rows[live], np.full(len(keep) - len(live), -1)])
                pick = mx.array(keep)
                keys = keys[:, pick]
                mx.eval(keys)
                values = values[:, pick]
                start, token, kstep = start[pick], token[pick], kstep[pick]
                ended = mx.where(mx.array(new_rows >= 0), ended[pick], True)
                if admit:
                    keys, values, start, token, ended, kstep, new_rows = _frozen_refill(
                        self, [entries[e] for e in admit], idx, T, pad_id, keys, values, start, token, ended, kstep,
                        new_rows, all_keys, sampler, join, s, segments)
                    for e in admit:
                        entries[e] = (*entries[e][:3], None)
                    last = max(last, s - 1 + T)
                rows, slot_rows = new_rows, None
        if slot_rows is None or len(slot_rows) != len(rows):
            slot_rows = mx.array(np.maximum(rows, 0))
        row_keys = all_keys[slot_rows, mx.minimum(kstep, T - 1)]
        if self.graph:
            if slot_at != idx:
                slot = mx.array([idx], dtype=mx.int32)
            token, logprob, entropy, ended, new_k, new_v, next_slot, kstep = step(
                weights, token, keys, values, slot, start, kstep, row_keys, ended)
            slot, slot_at = next_slot, idx + 1
        else:
            token, logprob, entropy, ended, new_k, new_v = step(weights, token, keys, values, idx - start, start,
                                                                mx.array([idx], dtype=mx.int32), row_keys, ended)
            kstep = kstep + 1
        keys[..., idx:idx + 1, :] = new_k
        values[..., idx:idx + 1, :] = new_v
        idx, s = idx + 1, s + 1
        self.row_steps += len(rows)
        self.steps += 1
        for column, value in zip(columns, (token, logprob, entropy)):
            column.append(value)
        mx.async_eval(token, logprob, entropy, ended)
    if turns is not None:
        return None
    segments.append((rows, opened, columns))
    ids, lps, ents, filled = assemble(segments, join, n_rows, T, pad_id)
    out, row = [], 0
    for job, _ in jobs:
        n = len(job) * G
        width = max(1, int(filled[row:row + n].max()))
        out.append(finish_rollout(tokenizer, job, mx.array(ids[row:row + n, :width]),
                                  mx.array(lps[row:row + n, :width]), mx.array(ents[row:row + n, :width]),
                                  eos_ids, pad_id, params, G, prefill_text))
        row += n
    return out


def _frozen_refill(self, admit, idx, T, pad_id, keys, values, start, token, ended, kstep, rows, all_keys, sampler,
                   join, s, segments):
    capacity = max(keys.shape[3], bucket(idx + T))
    if capacity > keys.shape[3]:
        grow = [(0, 0), (0, 0), (0, 0), (0, capacity - keys.shape[3]), (0, 0)]
        keys, values = mx.pad(keys, grow), mx.pad(values, grow)
    fresh, resumed = [e for e in admit if e[3] is None], [e for e in admit if e[3] is not None]
    parts = [_frozen_prefill(self, [e[0] for e in fresh], [e[2] for e in fresh], idx, capacity, pad_id)] \
        if fresh else []
    if resumed:
        *part, n = prefill_resumed(self.spec, _frozen_prefill_weights(self), [(e[0], e[3]) for e in resumed], idx,
                                   pad_id)
        slots = [(0, 0), (0, 0), (0, 0), (idx - part[0].shape[3], capacity - idx), (0, 0)]
        parts.append([mx.pad(part[0], slots), mx.pad(part[1], slots), *part[2:]])
        self.prefilled_tokens += n
    new_start, logits = (mx.concatenate([p[i] for p in parts]) for i in (2, 3))
    added = np.concatenate([first + np.arange(n) for _, first, n, _ in fresh + resumed])
    first_token, logprob, entropy, first_ended = sampler(logits, all_keys[mx.array(added), 0],
                                                         mx.zeros((len(added),), mx.bool_))
    join[added] = s - 1
    segments.append((added, s - 1, ([first_token], [logprob], [entropy])))
    keys = mx.concatenate([keys] + [p[0] for p in parts], axis=1)
    values = mx.concatenate([values] + [p[1] for p in parts], axis=1)
    mx.eval(keys, values)
    return (keys, values, mx.concatenate([start, new_start]), mx.concatenate([token, first_token]),
            mx.concatenate([ended, first_ended]), mx.concatenate([kstep, mx.ones((len(added),), mx.int32)]),
            np.concatenate([rows, added]))


# ---------------------------------------------------------------- the comparisons
class ManyEnds:
    """The tokenizer with one token in 12 counted as an end token: rows end early and at different steps."""

    def __init__(self, tok, ends: set[int]):
        self._tok = tok
        self.eos_token_ids = ends

    def __getattr__(self, name):
        return getattr(self._tok, name)


PROMPTS = [[17, 90], [120, 45, 203, 8, 77, 150, 33, 64, 99, 12, 250], [5, 6, 7]]


def same_rollouts(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.prompt_ids == w.prompt_ids and g.texts == w.texts and g.group_size == w.group_size
        for name in ("completion_ids", "mask", "sampler_logprobs", "entropies"):
            a, b = np.array(getattr(g, name)), np.array(getattr(w, name))
            assert a.shape == b.shape and a.dtype == b.dtype, name
            assert a.tobytes() == b.tobytes(), name  # to the bit
        assert g.truncated.tolist() == w.truncated.tolist()
        if w.transcripts is not None:
            assert [[(t.origin, t.text) for t in tr.turns] for tr in g.transcripts] == \
                   [[(t.origin, t.text) for t in tr.turns] for tr in w.transcripts]


def same_calls(got_calls, want_calls):
    """The callbacks: on_done's calls as the frozen loop made them; on_stop hears each row at most once (the
    frozen loop repeated rows at every sync, rows already ended by an end token or their limit included), with
    the same cut, and a stop the frozen loop heard of is heard of."""
    assert [c for c in got_calls if c[0] == "done"] == [c for c in want_calls if c[0] == "done"]
    got_stops, want_stops = [c for c in got_calls if c[0] == "stop"], [c for c in want_calls if c[0] == "stop"]
    assert len({c[1] for c in got_stops}) == len(got_stops)
    assert all(c in want_stops for c in got_stops)
    assert bool(got_stops) == bool(want_stops)


def both(engine, run):
    """run(generate_many) with the engine's loop, then with the frozen one: -> (got, want, got's calls, want's)."""
    results = []
    for generate in (engine.generate_many, partial(frozen_generate_many, engine)):
        calls = []
        out = run(generate, calls)
        results.append((out, calls, (engine.row_steps, engine.steps, engine.prefilled_tokens)))
    (got, got_calls, got_counts), (want, want_calls, want_counts) = results
    return got, want, got_calls, want_calls, got_counts, want_counts


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    model, tok = load_model(str(tiny_model_dir), "float32")
    return model, ManyEnds(tok, set(range(3, model.args.vocab_size, 12)))


def _jobs():
    jobs = [(PROMPTS * 2, mx.random.split(mx.random.key(10 + j), 24)) for j in range(2)]
    jobs.append(([[9] * 130, [4, 5]], mx.random.split(mx.random.key(30), 8)))  # longer than any slot before it
    return jobs


CASES = [  # (temperature, stop, ignore_eos, limits)
    (1.0, (), False, False), (1.0, ("a", "b"), False, True), (0.0, (), True, False), (0.7, ("a",), True, True)]


@pytest.mark.parametrize("compact,graph", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("temperature,stop,ignore_eos,limited", CASES)
def test_the_copy_samples_what_its_own_loop_did(tiny, monkeypatch, compact, graph, temperature, stop, ignore_eos,
                                                limited):
    model, tok = tiny
    in_place = []  # refills into done rows' slots (CopyDecoder.admit_into), the others rebuild the batch
    admit_into = CopyDecoder.admit_into
    monkeypatch.setattr(CopyDecoder, "admit_into", lambda self, *a: in_place.append(1) or admit_into(self, *a))
    engine = RolloutEngine(tok, mode="copy", compact=compact, sync_every=2, graph=graph).refresh(model)
    assert engine.uses_copy
    params = SamplingParams(40, temperature, stop=stop, ignore_eos=ignore_eos)
    limits = np.random.default_rng(0).integers(3, 45, size=56) if limited else None

    def run(generate, calls):
        return generate(_jobs(), 4, params, on_stop=lambda r, ids: calls.append(("stop", r, list(ids))),
                        limits=limits, on_done=lambda first, done: calls.append(("done", first, done.tolist())))

    got, want, got_calls, want_calls, got_counts, want_counts = both(engine, run)
    assert in_place or (ignore_eos and not limited)  # rows that all end together leave no refill in place
    same_rollouts(got, want)
    assert got_counts == want_counts
    same_calls(got_calls, want_calls)


@pytest.mark.parametrize("temperature,stop,ignore_eos,limited", CASES)
def test_the_model_path_samples_what_its_own_loop_did(tiny, temperature, stop, ignore_eos, limited):
    model, tok = tiny
    engine = RolloutEngine(tok, mode="model", sync_every=3).refresh(model)
    assert not engine.uses_copy
    params = SamplingParams(20, temperature, stop=stop, ignore_eos=ignore_eos)
    limits = np.random.default_rng(1).integers(2, 24, size=56) if limited else None

    def run(generate, calls):
        return generate(_jobs(), 4, params, on_stop=lambda r, ids: calls.append(("stop", r, list(ids))),
                        limits=limits, on_done=lambda first, done: calls.append(("done", first, done.tolist())))

    got, want, *_ = both(engine, run)
    same_rollouts(got, want)


@pytest.mark.parametrize("static_cache", [True, False])
def test_generate_rollout_samples_what_its_own_loop_did(tiny, static_cache):
    model, tok = tiny
    params = SamplingParams(24, 1.0, stop=("a",))
    got = decode.generate_rollout(model, tok, PROMPTS, 3, params, mx.random.key(4), static_cache=static_cache,
                                  sync_every=4)
    want = frozen_generate_rollout(model, tok, PROMPTS, 3, params, mx.random.key(4), static_cache=static_cache,
                                   sync_every=4)
    same_rollouts([got], [want])


@pytest.mark.parametrize("family", ["qwen3_next", "gemma3_text"])
def test_other_families_sample_what_their_own_loop_did(tmp_path, family):
    """Recurrent state (gated delta) and sliding-window caches of mlx-lm, through the model path."""
    model, tok = load_model(str(write_tiny_family(tmp_path / family, family)), "float32")
    params = SamplingParams(16, 1.0)
    keys = mx.random.split(mx.random.key(7), 6)
    prompts = [list(range(40, 52)), list(range(60, 100)), [5, 6]]
    got = decode.generate_rollout(model, tok, prompts, 2, params, keys, sync_every=4)
    want = frozen_generate_rollout(model, tok, prompts, 2, params, keys, sync_every=4)
    same_rollouts([got], [want])


class NotAtOnce(ToolEnvironment):
    """The calculator's environment with its answers taken at the next sync, as for a tool that takes time."""

    answers_at_once = False


@pytest.fixture(scope="module")
def caller(tmp_path_factory):
    return load_model(str(write_caller_model(tmp_path_factory.mktemp("caller"), CALLER)), "float32")


@pytest.mark.parametrize("mode,keep,graph,sync_every", [("copy", True, False, 2), ("copy", False, False, 3),
                                                        ("copy", True, True, 4), ("model", True, False, 2)])
def test_tool_turns_run_what_their_own_loop_ran(caller, monkeypatch, mode, keep, graph, sync_every):
    """Episodes of a llama that calls the calculator a varying number of times, two batch steps: on the copy the
    next turns join the running batch on their kept blocks (or prefilled whole); on the model they decode in
    waves."""
    model, tok = caller
    fmt = NanochatFormat(tok)
    # the frozen loop takes answers at the sync after the one that reported them: the engine does too for tools
    # that are not instant (the instant schedule is checked against this one below)
    multiturn = MultiTurn(NotAtOnce(["calculator"], fmt, max_turns=4), fmt, tok)
    rows = [{"prompt": f"q{i}", "answer": "5"} for i in range(4)]
    prompts = [multiturn.encode(r, "", "", 256)[0] for r in rows]
    keys = mx.random.split(mx.random.key(3), 16)
    params = SamplingParams(40, 1.0)
    engine = RolloutEngine(tok, mode=mode, sync_every=sync_every, keep_turn_cache=keep, graph=graph).refresh(model)
    jobs = [(prompts[:2], keys[:8], rows[:2]), (prompts[2:], keys[8:], rows[2:])]
    in_place = []  # refills that wrote the rows taken into done rows' slots (CopyDecoder.admit_into)
    admit_into = CopyDecoder.admit_into
    monkeypatch.setattr(CopyDecoder, "admit_into", lambda self, *a: in_place.append(1) or admit_into(self, *a))
    got = multiturn.generate_many(engine, jobs, 4, params)
    got_counts = engine.row_steps, engine.steps, engine.prefilled_tokens
    assert (len(in_place) > 0) == (mode == "copy")
    monkeypatch.setattr(RolloutEngine, "generate_many", frozen_generate_many)
    want = multiturn.generate_many(engine, jobs, 4, params)
    same_rollouts(got, want)
    if mode == "copy":
        assert got_counts == (engine.row_steps, engine.steps, engine.prefilled_tokens)
    calls = [sum(t.origin == "tool" for t in tr.turns) for r in got for tr in r.transcripts]
    assert len(set(calls)) >= 2  # rows called the tool a different number of times


@pytest.mark.parametrize("keep,graph", [(True, False), (False, False), (True, True)])
def test_instant_answers_change_the_schedule_not_the_tokens(caller, keep, graph):
    """The calculator answers at once (Tool.instant): the loop takes its answers at the sync that reported the
    calls, so next turns join a sync sooner. Every token, log-prob and transcript is the same as when the answers
    are taken at the next sync (answers_at_once off), to the bit in float32; the loop takes fewer decode steps."""
    model, tok = caller
    fmt = NanochatFormat(tok)
    rows = [{"prompt": f"q{i}", "answer": "5"} for i in range(4)]
    keys = mx.random.split(mx.random.key(5), 16)
    params = SamplingParams(40, 1.0)
    results = []
    for env in (ToolEnvironment(["calculator"], fmt, max_turns=4), NotAtOnce(["calculator"], fmt, max_turns=4)):
        assert env.answers_at_once == (type(env) is ToolEnvironment)  # the calculator is instant
        multiturn = MultiTurn(env, fmt, tok)
        prompts = [multiturn.encode(r, "", "", 256)[0] for r in rows]
        engine = RolloutEngine(tok, mode="copy", sync_every=4, keep_turn_cache=keep, graph=graph).refresh(model)
        out = multiturn.generate_many(engine, [(prompts, keys, rows)], 4, params)
        results.append((out, engine.steps, engine.row_steps))
    (fast, fast_steps, fast_row_steps), (slow, slow_steps, slow_row_steps) = results
    same_rollouts(fast, slow)
    calls = [sum(t.origin == "tool" for t in tr.turns) for r in fast for tr in r.transcripts]
    assert max(calls) >= 2
    assert fast_steps < slow_steps and fast_row_steps < slow_row_steps
