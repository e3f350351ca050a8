"""The gated-delta training path (models/gated_delta.py): the bounded scan's forward values bitwise those of
mlx-lm's ops path and its gradients those of autograd through it; the chunked form's values and gradients the
same to float rounding (across chunk boundaries, with masks, with keys that point alike, with a gate that
underflows); bounded_scan(model) changes neither a tiny Qwen3.5's loss nor its gradients beyond rounding."""

from __future__ import annotations

import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import gated_delta as ref

from mlx_grpo.models.gated_delta import bounded_gated_delta_update, bounded_scan, chunked_gated_delta, gated_delta_scan


def _inputs(B=2, T=13, Hk=2, Hv=4, Dk=8, Dv=6, vector_gate=False, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((B, T, Hk, Dk)) * 0.5
    k = mx.random.normal((B, T, Hk, Dk)) * 0.5
    v = mx.random.normal((B, T, Hv, Dv))
    a = mx.random.normal((B, T, Hv) + ((Dk,) if vector_gate else ()))
    b = mx.random.normal((B, T, Hv))
    A_log = mx.log(mx.random.uniform(1, 16, (Hv,) + ((1,) if vector_gate else ())))
    dt_bias = mx.random.normal((Hv,) + ((Dk,) if vector_gate else ()))
    state = mx.random.normal((B, Hv, Dv, Dk)) * 0.3
    mask = mx.random.uniform(shape=(B, T)) > 0.3
    return q, k, v, a, b, A_log, dt_bias, state, mask


def _update(fn, *args, state, mask, **kw):
    return fn(*args, state, mask, use_kernel=False, **kw)


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("vector_gate", [False, True])
def test_forward_values_equal_the_ops_path(with_state, with_mask, vector_gate):
    q, k, v, a, b, A_log, dt_bias, state, mask = _inputs(vector_gate=vector_gate)
    state, mask = (state if with_state else None), (mask if with_mask else None)
    y0, s0 = _update(ref.gated_delta_update, q, k, v, a, b, A_log, dt_bias, state=state, mask=mask)
    for chunk in (1, 4, 13, 64):  # chunk boundaries anywhere, including one chunk longer than T
        g = ref.compute_g(A_log, a, dt_bias)
        y1, s1 = gated_delta_scan(q, k, v, g, mx.sigmoid(b), state, mask, chunk=chunk)
        assert mx.array_equal(y0, y1).item() and mx.array_equal(s0, s1).item()
    y2, s2 = _update(bounded_gated_delta_update, q, k, v, a, b, A_log, dt_bias, state=state, mask=mask)
    if vector_gate:  # the scan
        assert mx.array_equal(y0, y2).item() and mx.array_equal(s0, s2).item()
    else:  # the chunked form: equal to float32 rounding where a token is real
        real = mx.ones(y0.shape[:2], dtype=mx.bool_) if mask is None else mask
        np.testing.assert_allclose(np.array(y2 * real[..., None, None]), np.array(y0 * real[..., None, None]),
                                   atol=2e-5)
        np.testing.assert_allclose(np.array(s2), np.array(s0), atol=2e-5)


def _hard_inputs(seed: int, neg_eigval: bool):
    """Keys that point nearly alike, writes near the largest step and little decay: the triangular system's
    power series overflows float32 here (the chunked form must not)."""
    B, T, H, D = 2, 150, 2, 16
    mx.random.seed(seed)
    unit = lambda x: x * mx.rsqrt((x * x).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
    q = unit(mx.random.normal((B, T, H, D))) * D ** -0.5
    k = unit(mx.random.normal((1, 1, H, D)) + 0.05 * mx.random.normal((B, T, H, D)))
    v = mx.random.normal((B, T, H, D))
    beta = mx.full((B, T, H), 1.9 if neg_eigval else 0.99)
    g = mx.full((B, T, H), 0.999)
    return q, k, v, g, beta, mx.random.normal((B, H, D, D)) * 0.1


def test_a_gate_that_underflows_to_zero_forgets_instead_of_turning_nan():
    """exp(-A * softplus(a + dt_bias)) is 0 in float32 once its exponent passes ~87 (A = 16, a = 30 here): the
    chunked path takes the gate's log from the formula, so the state is wiped, not NaN."""
    q, k, v, a, b, A_log, dt_bias, state, mask = _inputs(seed=5, T=40)
    a = a.at[:, 20].add(30.0)
    A_log = mx.full(A_log.shape, float(np.log(16.0)))
    assert (ref.compute_g(A_log, a, dt_bias)[:, 20] == 0).all().item()
    y0, s0 = _update(ref.gated_delta_update, q, k, v, a, b, A_log, dt_bias, state=state, mask=None)
    y1, s1 = _update(bounded_gated_delta_update, q, k, v, a, b, A_log, dt_bias, state=state, mask=None)
    np.testing.assert_allclose(np.array(y1), np.array(y0), atol=2e-5)
    np.testing.assert_allclose(np.array(s1), np.array(s0), atol=2e-5)
    grads = mx.grad(lambda a: _update(bounded_gated_delta_update, q, k, v, a, b, A_log, dt_bias, state=state,
                                      mask=None)[0].sum())(a)
    assert mx.isfinite(grads).all().item()


@pytest.mark.parametrize("chunk", [16, 32, 64])
@pytest.mark.parametrize("neg_eigval", [False, True])
def test_chunked_form_equals_the_scan_where_the_power_series_overflows(chunk, neg_eigval):
    q, k, v, g, beta, state = _hard_inputs(0, neg_eigval)
    y0, s0 = ref.gated_delta_ops(q, k, v, g, beta, state)
    y1, s1 = chunked_gated_delta(q, k, v, mx.log(g), beta, state, chunk=chunk)
    scale = 1e-4 if neg_eigval else 1e-5  # doubled writes: the recurrence itself amplifies rounding
    np.testing.assert_allclose(np.array(y1), np.array(y0), atol=scale)
    np.testing.assert_allclose(np.array(s1), np.array(s0), atol=10 * scale)


@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("T", [13, 150])  # inside one chunk, and across chunk boundaries
def test_chunked_form_gradients_equal_autograd_through_the_ops_path(with_mask, chunk, T):
    q, k, v, a, b, A_log, dt_bias, state, mask = _inputs(seed=2, T=T)
    mask = mask if with_mask else None
    real = mx.ones(q.shape[:2], dtype=mx.bool_) if mask is None else mask
    wy = mx.random.normal((q.shape[0], q.shape[1], v.shape[2], v.shape[3])) * real[..., None, None]
    ws = mx.random.normal(state.shape)

    def loss(fn, q, k, v, a, b, A_log, dt_bias, state):
        y, s = fn(q, k, v, ref.compute_g(A_log, a, dt_bias), mx.sigmoid(b), state, mask)
        return (y * wy).sum() + (s * ws).sum()

    args = (q, k, v, a, b, A_log, dt_bias, state)
    l0, g0 = mx.value_and_grad(loss, tuple(range(1, 9)))(ref.gated_delta_ops, *args)
    chunked = lambda q, k, v, g, *x: chunked_gated_delta(q, k, v, mx.log(g), *x, chunk=chunk)  # noqa: E731
    l1, g1 = mx.value_and_grad(loss, tuple(range(1, 9)))(chunked, *args)
    assert l1.item() == pytest.approx(l0.item(), rel=1e-5)
    for want, got in zip(g0, g1):
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-3, atol=5e-5)


def test_gate_options_match():
    q, k, v, a, b, A_log, dt_bias, state, mask = _inputs(vector_gate=True)
    for kw in ({"lower_bound": -5.0}, {"allow_neg_eigval": True}):
        y0, s0 = _update(ref.gated_delta_update, q, k, v, a, b, A_log, dt_bias, state=state, mask=mask, **kw)
        y1, s1 = _update(bounded_gated_delta_update, q, k, v, a, b, A_log, dt_bias, state=state, mask=mask, **kw)
        assert mx.array_equal(y0, y1).item() and mx.array_equal(s0, s1).item()


@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("vector_gate", [False, True])
@pytest.mark.parametrize("chunk", [None, 3])
def test_gradients_equal_autograd_through_the_ops_path(with_mask, vector_gate, chunk):
    q, k, v, a, b, A_log, dt_bias, state, mask = _inputs(vector_gate=vector_gate, seed=1)
    mask = mask if with_mask else None
    wy = mx.random.normal((q.shape[0], q.shape[1], v.shape[2], v.shape[3]))
    ws = mx.random.normal(state.shape)

    def loss(scan, q, k, v, a, b, A_log, dt_bias, state):
        beta = mx.sigmoid(b)
        g = ref.compute_g(A_log, a, dt_bias)
        y, s = scan(q, k, v, g, beta, state, mask)
        return (y * wy).sum() + (s * ws).sum()

    argnums = tuple(range(1, 9))  # q, k, v, a (g), b (beta), A_log, dt_bias, the initial state
    args = (q, k, v, a, b, A_log, dt_bias, state)
    l0, g0 = mx.value_and_grad(loss, argnums)(ref.gated_delta_ops, *args)
    bounded = lambda *x: gated_delta_scan(*x, chunk=chunk)  # noqa: E731
    l1, g1 = mx.value_and_grad(loss, argnums)(bounded, *args)
    assert l0.item() == l1.item()
    for want, got in zip(g0, g1):
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-4, atol=2e-5)


def _tiny_qwen3_5(tmp_path, family="qwen3_5"):
    from mlx_lm import load

    from mlx_grpo.models.tiny import write_tiny_family

    model, _ = load(str(write_tiny_family(tmp_path / family, family)))
    return model


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_bounded_scan_keeps_a_tiny_models_loss_and_gradients(tmp_path, family):
    model = _tiny_qwen3_5(tmp_path, family)
    mx.random.seed(3)
    tokens = mx.random.randint(0, 200, (2, 24))

    def loss(model):
        logits = model(tokens[:, :-1]).astype(mx.float32)
        return nn.losses.cross_entropy(logits, tokens[:, 1:]).mean()

    grad = nn.value_and_grad(model, loss)
    l0, g0 = grad(model)
    mx.eval(l0, g0)
    with bounded_scan(model):
        calls = []
        import importlib
        module = importlib.import_module(f"mlx_lm.models.{family}")
        original = module.gated_delta_update
        module.gated_delta_update = lambda *a, **kw: calls.append(1) or original(*a, **kw)
        try:
            l1, g1 = grad(model)
            mx.eval(l1, g1)
        finally:
            module.gated_delta_update = original
        assert calls  # the model's layers went through the switch
    assert l1.item() == pytest.approx(l0.item(), rel=1e-6)  # the chunked form: equal to float32 rounding
    flat0, flat1 = dict(tree_flatten(g0)), dict(tree_flatten(g1))
    assert flat0.keys() == flat1.keys() and any("linear_attn" in key for key in flat0)
    for key in flat0:
        np.testing.assert_allclose(np.array(flat1[key]), np.array(flat0[key]), rtol=1e-3, atol=2e-6, err_msg=key)  # chunked: other sum order


def test_bounded_scan_is_scoped_and_restores(tmp_path):
    import mlx_lm.models.qwen3_5 as q35
    import mlx_lm.models.qwen3_next as q3n

    from mlx_grpo.models.tiny import write_tiny_family

    model = _tiny_qwen3_5(tmp_path)
    original = q35.gated_delta_update
    with bounded_scan(model):
        assert q35.gated_delta_update is not original and q3n.gated_delta_update is ref.gated_delta_update
        with bounded_scan(model):  # nested: still switched after the inner exit
            pass
        assert q35.gated_delta_update is not original
        seen = {}
        # another thread sees the dispatcher but not this thread's switch: it keeps mlx-lm's function
        thread = threading.Thread(target=lambda: seen.update(active=_active()))
        thread.start()
        thread.join()
        assert _active() and seen == {"active": False}
    assert q35.gated_delta_update is original

    from mlx_lm import load
    llama, _ = load(str(write_tiny_family(tmp_path / "llama", "llama")))
    with bounded_scan(llama):  # no gated-delta layers: nothing changes
        assert q35.gated_delta_update is original and not _active()


def test_bounded_scan_inside_a_checkpointed_layer(tmp_path, monkeypatch):
    """mx.checkpoint recomputes the layer in the backward pass, after the forward's `with` has closed: entering
    bounded_scan inside the checkpointed function keeps the recompute bounded too."""
    from mlx_grpo.models import gated_delta

    model = _tiny_qwen3_5(tmp_path)
    layer = next(layer for layer in model.layers if layer.is_linear)
    calls, real = [], gated_delta.bounded_gated_delta_update
    monkeypatch.setattr(gated_delta, "bounded_gated_delta_update", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    mx.random.seed(4)
    x, w = mx.random.normal((2, 12, 32)), mx.random.normal((2, 12, 32))

    def run(params, x):
        layer.update(params)
        with bounded_scan(layer):
            return layer(x)

    params = layer.trainable_parameters()
    g1 = mx.grad(lambda p, x: (mx.checkpoint(run)(p, x) * w).sum(), argnums=(0, 1))(params, x)
    mx.eval(g1)
    assert len(calls) == 2  # the forward and the backward's recompute

    def plain(p, x):
        layer.update(p)
        return (layer(x) * w).sum()

    g0 = mx.grad(plain, argnums=(0, 1))(params, x)
    for (key, want), (_, got) in zip(tree_flatten(g0), tree_flatten(g1)):
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-5, err_msg=key)  # chunked: rounding


def _active() -> bool:
    from mlx_grpo.models import gated_delta

    return gated_delta._ACTIVE.get()


def test_concurrent_forwards_under_the_switch(tmp_path):
    """One thread trains under bounded_scan while another runs the same model's forward: both get the values
    they get alone."""
    model = _tiny_qwen3_5(tmp_path)
    tokens = mx.array([[5, 9, 17, 33, 2, 8, 40, 41, 7, 3]])
    want = model(tokens)
    mx.eval(want)
    results, errors = [], []

    def run(switched):
        try:
            for _ in range(5):
                with bounded_scan(model) if switched else _nothing():
                    out = model(tokens)
                    mx.eval(out)
                results.append(mx.allclose(out, want, atol=1e-5).item() if switched else
                               mx.array_equal(out, want).item())
        except Exception as exc:  # pragma: no cover - surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i % 2 == 0,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [True] * 20


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
