"""compile_update (training/compiled_update.py): the compiled optimizer step gives the eager step's weights, optimizer state
and float32 masters after 3 updates (float32 tolerance), with and without masters, and through a resume
that replaces the optimizer's state; a training run with it matches one without."""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm import load

from mlx_grpo.models.precision import cast_floats
from mlx_grpo.training.compiled_update import CompiledUpdate
from mlx_grpo.training.optimization import MasterWeights, optimizer_step


def _close(a, b, atol):
    fa, fb = dict(tree_flatten(a)), dict(tree_flatten(b))
    assert fa.keys() == fb.keys()
    for k in fa:
        np.testing.assert_allclose(np.array(fa[k].astype(mx.float32)), np.array(fb[k].astype(mx.float32)),
                                   atol=atol, rtol=0, err_msg=k)


def _grads(model, seed):
    """A gradient-shaped tree of the trained tensors (float32, as accumulate_gradients hands them over)."""
    mx.random.seed(seed)
    return tree_map(lambda p: mx.random.normal(p.shape) * 1e-2, model.trainable_parameters())


@pytest.mark.parametrize("dtype,masters", [(mx.float32, False), (mx.bfloat16, True), (mx.bfloat16, False)])
def test_compiled_update_equals_eager_after_three_updates(tiny_model_dir, dtype, masters):
    model, _ = load(str(tiny_model_dir))
    runs = []
    for compiled in (False, True):
        m = copy.deepcopy(model)
        mw = MasterWeights(m, enabled=masters)  # taken before the cast, as assembly does
        cast_floats(m, dtype)
        opt = optim.AdamW(learning_rate=1e-3, betas=[0.9, 0.99], weight_decay=0.1, bias_correction=True)
        update = CompiledUpdate(opt, m, mw) if compiled else None
        for i in range(3):
            opt.learning_rate = mx.array(1e-3 * (3 - i), dtype=mx.float32)  # a schedule, as the trainer sets it
            g = _grads(m, i)
            update.step(g) if compiled else optimizer_step(opt, m, g, mw)
            mx.eval(m.parameters(), opt.state, mw.arrays())
        runs.append((m, opt, mw, update))
    (m0, o0, w0, _), (m1, o1, w1, update) = runs
    assert update.traces == 1
    atol = 1e-6 if dtype == mx.float32 or masters else 1e-2  # bf16 weights: one rounding step apart at most
    _close(m0.parameters(), m1.parameters(), atol)
    _close(o0.state, o1.state, 1e-6)
    if masters:
        _close(w0.masters, w1.masters, 1e-6)
        assert all(v.dtype == mx.float32 for v in w1.masters.values())
    assert all(p.dtype == dtype for _, p in tree_flatten(m1.parameters()))


def test_compiled_update_follows_a_replaced_state(tiny_model_dir):
    """Resume replaces the optimizer's state dict and the masters' dict: the next step uses the new ones."""
    model, _ = load(str(tiny_model_dir))
    m = copy.deepcopy(model)
    mw = MasterWeights(m, enabled=True)
    opt = optim.AdamW(learning_rate=1e-3)
    update = CompiledUpdate(opt, m, mw)
    update.step(_grads(m, 0))
    mx.eval(m.parameters(), opt.state, mw.arrays())
    saved_state, saved_masters = tree_map(lambda x: x, opt.state), dict(mw.masters)
    reference = copy.deepcopy(m), optim.AdamW(learning_rate=1e-3), MasterWeights(m, enabled=True)
    reference[1].state, reference[2].masters = tree_map(lambda x: x, saved_state), dict(saved_masters)
    update.step(_grads(m, 1))  # moves on
    opt.state, mw.masters = saved_state, saved_masters  # what restore() does
    update.step(_grads(m, 2))
    mx.eval(m.parameters(), opt.state, mw.arrays())
    optimizer_step(reference[1], reference[0], _grads(m, 2), reference[2])
    _close(mw.masters, reference[2].masters, 1e-6)
    assert update.traces == 2


def test_compiled_update_trains_a_model(tiny_model_dir):
    """Not a no-op: the loss of a fixed batch falls under compiled updates."""
    model, _ = load(str(tiny_model_dir))
    mw = MasterWeights(model, enabled=False)
    opt = optim.AdamW(learning_rate=1e-2)
    update = CompiledUpdate(opt, model, mw)
    x = mx.array([[5, 6, 7, 8, 9, 10]])

    def loss(m):
        return nn.losses.cross_entropy(m(x[:, :-1]), x[:, 1:]).mean()

    grad = nn.value_and_grad(model, loss)
    first, _ = grad(model)
    for _ in range(5):
        _, g = grad(model)
        update.step(g)
        mx.eval(model.parameters(), opt.state)
    assert loss(model).item() < first.item() - 0.1


@pytest.mark.parametrize("extra", [["compile_update=true"],
                                   ["compile_update=true", "model_dtype=bfloat16", "learning_rate=1e-4",
                                    "rollout_engine=copy", "decode_graph=true"]])
def test_runs_with_the_speed_options_resume_exactly_and_follow_the_eager_run(tiny_model_dir, tmp_path, monkeypatch,
                                                                            extra):
    from conftest import interrupt_before_update, run_metrics
    from test_trainer import FIXTURES, make_cfg, weights

    from mlx_grpo.commands import train as run_mod

    extra = [f"reward_funcs={FIXTURES / 'toy_rewards.py'}:share_of_even_ids", *extra]  # a reward that varies
    base = [e for e in extra if not e.startswith(("compile_update", "decode_graph"))]
    eager = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=eager", "save_steps=2", *base))
    full = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "run_name=full", "save_steps=2", *extra))
    cfg = make_cfg(tiny_model_dir, tmp_path, "run_name=cut", "save_steps=2", *extra)
    interrupt_before_update(run_mod.train, cfg, monkeypatch, 3)
    resumed = run_mod.train(cfg, resume="latest")
    assert run_metrics(resumed) == run_metrics(full)  # resume is exact with the options on
    last = max(int(p.name.split("-")[1]) for p in full.glob("checkpoint-*"))
    a, b = weights(full / f"checkpoint-{last}"), weights(resumed / f"checkpoint-{last}")
    assert all(np.array_equal(np.array(a[k].astype(mx.float32)), np.array(b[k].astype(mx.float32))) for k in a)
    # and the run is the eager one's: the same completions (rewards), the losses within rounding
    got, want = run_metrics(full), run_metrics(eager)
    assert len(got) == len(want) >= 4 and any(m["grad_norm"] > 0 for m in want)
    for x, y in zip(got, want):
        assert x["reward_mean"] == y["reward_mean"]
        for key in ("loss", "grad_norm"):
            assert abs(x[key] - y[key]) <= 1e-4 * max(1.0, abs(y[key])), key
