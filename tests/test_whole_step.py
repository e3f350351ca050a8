"""decode_whole_step (models/whole_step.py): the engine's step with the cache write, the step keys and the
slot/step counters inside the one compiled call samples the same tokens with the same log-probs as today's
step for the same keys (float32, CPU), through compaction, refill, stop strings, greedy decoding and later
turns; one trace serves every cache length of a capacity; the cache is written in place (donated)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from caller_model import CALLER, write_caller_model
from mlx_lm import load
from test_engine import PROMPTS, _family_model, _many_ends

from mlx_grpo.config import build_config, parse_set
from mlx_grpo.errors import UserError
from mlx_grpo.models import decoder, whole_step
from mlx_grpo.models.loading import load_model
from mlx_grpo.rollout.engine import RolloutEngine
from mlx_grpo.rollout.multiturn import MultiTurn
from mlx_grpo.rollout.records import SamplingParams
from mlx_grpo.rollout.sampling import sample
from mlx_grpo.tools.calls import NanochatFormat
from mlx_grpo.tools.environments import ToolEnvironment


@pytest.fixture()
def tiny(tiny_model_dir):
    return load(str(tiny_model_dir))


def _same(a, b):
    """Bit-equal: the same matrices and kernels on the same shapes (only where they are evaluated differs)."""
    assert a.texts == b.texts and a.completion_ids.tolist() == b.completion_ids.tolist()
    assert a.mask.tolist() == b.mask.tolist() and a.truncated.tolist() == b.truncated.tolist()
    np.testing.assert_array_equal(np.array(a.sampler_logprobs), np.array(b.sampler_logprobs))
    np.testing.assert_array_equal(np.array(a.entropies), np.array(b.entropies))


@pytest.mark.parametrize("temperature,stop", [(1.0, ()), (0.0, ()), (0.7, ("a",))])
def test_whole_step_samples_what_todays_step_samples(tiny, temperature, stop):
    model, tok = tiny
    ends = _many_ends(tok, model.args.vocab_size)  # rows end at different steps: compaction runs
    params = SamplingParams(48, temperature, stop=stop)
    prompts = PROMPTS * 4
    today = RolloutEngine(ends, mode="copy", sync_every=2).refresh(model)
    whole = RolloutEngine(ends, mode="copy", sync_every=2, whole=True).refresh(model)
    _same(whole.generate(prompts, 4, params, mx.random.key(7)), today.generate(prompts, 4, params, mx.random.key(7)))
    assert whole.row_steps == today.row_steps  # the same compactions ran
    if temperature == 1.0:
        assert whole.row_steps < 48 * 48


def test_whole_step_refills_as_todays_step(tiny):
    model, tok = tiny
    ends = _many_ends(tok, model.args.vocab_size)
    params = SamplingParams(40, 1.0)
    jobs = [(PROMPTS * 2, mx.random.split(mx.random.key(10 + j), 24)) for j in range(2)]
    jobs.append(([[9] * 130, [4, 5]], mx.random.split(mx.random.key(30), 8)))  # skips the slot ahead, grows the cache
    want = RolloutEngine(ends, mode="copy", sync_every=2).refresh(model).generate_many(jobs, 4, params)
    got = RolloutEngine(ends, mode="copy", sync_every=2, whole=True).refresh(model).generate_many(jobs, 4, params)
    for a, b in zip(got, want):
        _same(a, b)


def test_later_turns_decode_as_with_todays_step(tmp_path):
    """Tool calls: rows' next turns join the running batch (their step keys appended mid-decode)."""
    model, tok = load_model(str(write_caller_model(tmp_path / "caller", CALLER)), "float32")
    fmt = NanochatFormat(tok)
    rows = [{"prompt": f"q{i}", "answer": "5"} for i in range(4)]
    out = []
    for whole in (False, True):
        multiturn = MultiTurn(ToolEnvironment(["calculator"], fmt, max_turns=4), fmt, tok)
        prompts = [multiturn.encode(r, "", "", 256)[0] for r in rows]
        keys = mx.random.split(mx.random.key(3), 16)
        engine = RolloutEngine(tok, mode="copy", sync_every=2, whole=whole).refresh(model)
        jobs = [(prompts[:2], keys[:8], rows[:2]), (prompts[2:], keys[8:], rows[2:])]
        out.append(multiturn.generate_many(engine, jobs, 4, SamplingParams(40, 1.0)))
    for a, b in zip(*out):
        _same(a, b)
    calls = [sum(t.origin == "tool" for t in tr.turns) for r in out[1] for tr in r.transcripts]
    assert len(set(calls)) >= 2  # rows called the tool a different number of times


def test_one_trace_serves_every_cache_length(tiny):
    """Slot, step counters and step keys are arrays: decoding 60 steps (60 cache lengths), then other prompts
    ending at other slots of the same capacity, traces the step once; only a new capacity traces again."""
    model, tok = tiny
    engine = RolloutEngine(tok, mode="copy", compact=False, whole=True).refresh(model)
    params = SamplingParams(60, 1.0, ignore_eos=True)
    engine.generate(PROMPTS, 2, params, mx.random.key(1))
    assert engine.traces == 1 and engine.steps == 59
    engine.generate([[3] * 20, [4, 5, 6, 7], [8]], 2, params, mx.random.key(2))  # other lengths, same bucket
    assert engine.traces == 1
    engine.refresh(model).generate(PROMPTS, 2, params, mx.random.key(3))  # new weights: the trace is kept
    assert engine.traces == 1
    engine.generate(PROMPTS, 2, SamplingParams(90, 1.0, ignore_eos=True), mx.random.key(1))
    assert engine.traces == 2


def _address(a: mx.array) -> int:
    return np.asarray(a).__array_interface__["data"][0]  # the numpy view dies at once: no reference kept


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_step_writes_the_cache_in_place_and_equals_the_copys_step(kind):
    """The compiled step on a family model (biases, q/k norms, untied head) at several cache lengths: its
    logits' samples, keys and values are decoder.decode_step's written at the slot, later slots untouched,
    and the cache buffer stays the same one (donated, not copied), with the caller keeping no reference."""
    model = _family_model(kind)
    spec, weights = decoder.build(model, mx.float32)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    width, extra = 6, 6
    start = mx.array([width - len(p) for p in prompts], dtype=mx.int32)
    tokens = mx.array([[0] * (width - len(p)) + p for p in prompts])
    _, keys, values = decoder.prefill(spec, weights, tokens, start)
    tail = [(0, 0), (0, 0), (0, 0), (0, extra), (0, 0)]
    keys, values = mx.pad(mx.stack(keys), tail), mx.pad(mx.stack(values), tail)
    params = SamplingParams(extra, 1.0)
    step = whole_step.make_step(spec, lambda logits, k: sample(logits, k, params), mx.array([-1], mx.int32), False)
    step_keys = mx.random.split(mx.random.key(0), 2 * extra).reshape(2, extra, 2)
    token, slot, kstep, ended = mx.array([20, 21]), mx.array([width], mx.int32), mx.ones((2,), mx.int32), \
        mx.zeros((2,), mx.bool_)
    mx.eval(keys, values)
    addresses = []
    for idx in range(width, width + extra):
        ref_keys, ref_values = np.array(keys), np.array(values)
        logits, want_k, want_v = decoder.decode_step(spec, weights, token, keys, values, idx - start, start,
                                                     mx.array([idx]), kernel=False)
        want = sample(logits, step_keys[:, min(idx - width + 1, extra - 1)], params)
        token, logprob, entropy, ended, keys, values, slot, kstep = step(weights, token, keys, values, slot, start,
                                                                         kstep, step_keys, ended)
        mx.async_eval(token, logprob, entropy, ended)  # as the engine: the write runs after the cache's reads
        assert token.tolist() == want[0].tolist()
        np.testing.assert_array_equal(np.array(logprob), np.array(want[1]))
        ref_keys[:, :, :, idx:idx + 1], ref_values[:, :, :, idx:idx + 1] = np.array(want_k), np.array(want_v)
        np.testing.assert_array_equal(np.array(keys), ref_keys)  # the slot written, every other slot as it was
        np.testing.assert_array_equal(np.array(values), ref_values)
        addresses.append(_address(keys))
        assert slot.tolist() == [idx + 1]
    assert len(set(addresses)) == 1  # one buffer all along: a copy would have needed a second one


@pytest.mark.parametrize("items,message", [
    (["decode_whole_step=true", "decode_graph=true"], "decode_graph and decode_whole_step"),
    (["decode_whole_step=true", "rollout_engine=model"], "decode_whole_step = true needs the sampling copy"),
])
def test_bad_whole_step_settings_are_one_line(items, message):
    with pytest.raises(UserError, match=message):
        build_config("train", overrides=parse_set(["model_name=m", *items]))


def test_a_training_run_with_it_is_the_run_without_it(tiny_model_dir, tmp_path, monkeypatch):
    """decode_whole_step reaches the trainer's engine, and a run with it is bitwise the run without it."""
    from conftest import run_metrics
    from test_trainer import FIXTURES, make_cfg, weights

    from mlx_grpo import run as run_mod

    made, real = [], whole_step.make_step
    monkeypatch.setattr(whole_step, "make_step", lambda *a, **k: made.append(1) or real(*a, **k))
    extra = [f"reward_funcs={FIXTURES / 'toy_rewards.py'}:share_of_even_ids", "rollout_engine=copy"]
    runs = []
    for i, more in enumerate([[], ["decode_whole_step=true"]]):
        runs.append(run_mod.train(make_cfg(tiny_model_dir, tmp_path, f"run_name=r{i}", "save_steps=2", *extra, *more)))
        assert bool(made) == (i == 1)  # the whole step was built for the second run only
    assert run_metrics(runs[0]) == run_metrics(runs[1]) and len(run_metrics(runs[0])) >= 4
    last = max(int(p.name.split("-")[1]) for p in runs[0].glob("checkpoint-*"))
    a, b = (weights(r / f"checkpoint-{last}") for r in runs)
    assert all(np.array_equal(np.array(a[k]), np.array(b[k])) for k in a)
