"""decode_graph (models/compiled_decode.py): the engine's step with fewer primitives samples the same tokens
with the same log-probs as today's step for the same keys (float32, CPU), through compaction, refill, stop
strings and greedy decoding; one trace serves every cache length; the families' forward is the copy's."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from test_engine import PROMPTS, _family_model, _many_ends

from mlx_grpo.models import compiled_decode, decoder
from mlx_grpo.rollout.engine import RolloutEngine
from mlx_grpo.rollout.rollout_records import SamplingParams


@pytest.fixture()
def tiny(tiny_model_dir):
    return load(str(tiny_model_dir))


def _same(a, b):
    assert a.lengths.tolist() == b.lengths.tolist() and a.texts == b.texts
    assert a.completion_ids.tolist() == b.completion_ids.tolist()
    assert a.truncated.tolist() == b.truncated.tolist()
    np.testing.assert_allclose(np.array(a.sampler_logprobs), np.array(b.sampler_logprobs), atol=2e-5)
    np.testing.assert_allclose(np.array(a.entropies), np.array(b.entropies), atol=2e-5)


@pytest.mark.parametrize("temperature,stop", [(1.0, ()), (0.0, ()), (0.7, ("a",))])
def test_graph_step_samples_what_todays_step_samples(tiny, temperature, stop):
    model, tok = tiny
    ends = _many_ends(tok, model.args.vocab_size)  # rows end at different steps: compaction runs
    params = SamplingParams(48, temperature, stop=stop)
    prompts = PROMPTS * 4
    today = RolloutEngine(ends, mode="copy", sync_every=2).refresh(model)
    graph = RolloutEngine(ends, mode="copy", sync_every=2, graph=True).refresh(model)
    a = today.generate(prompts, 4, params, mx.random.key(7))
    b = graph.generate(prompts, 4, params, mx.random.key(7))
    _same(a, b)
    assert graph.row_steps == today.row_steps  # the same compactions ran
    if temperature == 1.0:  # rows ended at different steps and were dropped
        assert graph.row_steps < 48 * 48 and a.lengths.min() < 8 and a.lengths.max() > 24


def test_graph_step_refills_as_todays_step(tiny):
    model, tok = tiny
    ends = _many_ends(tok, model.args.vocab_size)
    params = SamplingParams(40, 1.0)
    jobs = [(PROMPTS * 2, mx.random.split(mx.random.key(10 + j), 24)) for j in range(2)]
    jobs.append(([[9] * 130, [4, 5]], mx.random.split(mx.random.key(30), 8)))  # skips the slot ahead
    want = RolloutEngine(ends, mode="copy", sync_every=2).refresh(model).generate_many(jobs, 4, params)
    graph = RolloutEngine(ends, mode="copy", sync_every=2, graph=True).refresh(model)
    got = graph.generate_many(jobs, 4, params)
    for a, b in zip(got, want):
        _same(a, b)


def test_one_trace_serves_every_cache_length(tiny):
    """The cache slot is a device array the graph advances: decoding 60 steps (60 cache lengths), then other
    prompts ending at other slots of the same capacity, traces the step once; only a new cache capacity
    (another max_new_tokens) traces it again."""
    model, tok = tiny
    engine = RolloutEngine(tok, mode="copy", compact=False, graph=True).refresh(model)
    params = SamplingParams(60, 1.0, ignore_eos=True)
    engine.generate(PROMPTS, 2, params, mx.random.key(1))
    assert engine.traces == 1 and engine.steps == 59
    engine.generate([[3] * 20, [4, 5, 6, 7], [8]], 2, params, mx.random.key(2))  # other lengths, same bucket
    assert engine.traces == 1
    engine.refresh(model).generate(PROMPTS, 2, params, mx.random.key(3))  # new weights: the trace is kept
    assert engine.traces == 1
    engine.generate(PROMPTS, 2, SamplingParams(90, 1.0, ignore_eos=True), mx.random.key(1))
    assert engine.traces == 2


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_graph_step_is_the_copys_step_for_the_families(kind):
    """Biases, q/k norms and an untied head: the step equals decoder.decode_step at several cache lengths."""
    model = _family_model(kind)
    spec, weights = decoder.build(model, mx.float32)
    graph = compiled_decode.graph_weights(weights)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    width, extra = 6, 5
    padding = mx.array([width - len(p) for p in prompts], dtype=mx.int32)
    tokens = mx.array([[0] * (width - len(p)) + p for p in prompts])
    _, keys, values = decoder.prefill(spec, compiled_decode.model_layout(graph), tokens, padding)
    tail = [(0, 0), (0, 0), (0, 0), (0, extra), (0, 0)]
    keys, values = mx.pad(mx.stack(keys), tail), mx.pad(mx.stack(values), tail)
    token = mx.array([20, 21])
    for idx in range(width, width + extra):
        want, want_k, want_v = decoder.decode_step(spec, weights, token, keys, values, idx - padding, padding,
                                                   mx.array([idx]), kernel=False)
        slot = mx.array([idx], dtype=mx.int32)
        got, new_k, new_v = compiled_decode.decode_step(spec, graph, token, keys, values, slot, padding, False)
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5)
        # the matmuls' operand layout may move a float's last bits
        np.testing.assert_allclose(np.array(new_k), np.array(want_k), atol=1e-5)
        np.testing.assert_allclose(np.array(new_v), np.array(want_v), atol=1e-5)
        keys[:, :, :, idx:idx + 1] = new_k  # as the engine writes it
        values[:, :, :, idx:idx + 1] = new_v
        np.testing.assert_array_equal(np.array(keys[:, :, :, idx:idx + 1]), np.array(new_k))
        assert not np.array(keys[:, :, :, idx + 1:]).any()  # later slots untouched
        token = mx.argmax(got, axis=-1)


@pytest.mark.parametrize("max_new_tokens,sync_every", [(40, 2), (13, 4), (40, 8)])
def test_graph_step_runs_tool_turns_as_todays_step(tmp_path, max_new_tokens, sync_every):
    """Tool turns: a row's next turn (the tool's answer prefilled) joins the running batch. decode_graph gives
    the default step's texts, tokens and log-probs, two jobs, tight and loose syncs (the skip-ahead of idx
    is covered by test_graph_step_refills_as_todays_step)."""
    from caller_model import CALLER, write_caller_model
    from mlx_grpo.models.model_loading import load_model
    from mlx_grpo.rollout.multiturn import MultiTurn
    from mlx_grpo.tools.calls import NanochatFormat
    from mlx_grpo.tools.environments import ToolEnvironment

    model, tok = load_model(str(write_caller_model(tmp_path / "caller", CALLER)), "float32")
    fmt = NanochatFormat(tok)
    turns = MultiTurn(ToolEnvironment(["calculator"], fmt, max_turns=4), fmt, tok)
    rows = [{"prompt": f"q{i}", "answer": "5"} for i in range(4)]
    prompts = [turns.encode(r, "", "", 256)[0] for r in rows]
    keys = mx.random.split(mx.random.key(3), 16)
    jobs = [(prompts[:2], keys[:8], rows[:2]), (prompts[2:], keys[8:], rows[2:])]
    params = SamplingParams(max_new_tokens, 1.0)
    today, graph = (turns.generate_many(RolloutEngine(tok, mode="copy", sync_every=sync_every, graph=g)
                                        .refresh(model), jobs, 4, params) for g in (False, True))
    calls = 0
    for a, b in zip(today, graph):
        assert a.texts == b.texts
        assert a.completion_ids.tolist() == b.completion_ids.tolist()
        np.testing.assert_allclose(np.array(a.sampler_logprobs), np.array(b.sampler_logprobs), atol=1e-5)
        calls += sum(t.origin == "tool" for tr in a.transcripts for t in tr.turns)
    assert calls > 0  # the turns this test is for happened
