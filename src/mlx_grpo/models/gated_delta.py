"""A memory-bounded, differentiable gated-delta scan for mlx-lm's linear-attention layers (Qwen3.5, Qwen3-Next,
Kimi-Linear, OLMo-hybrid, ...), and `bounded_scan(model)`, the scoped switch that makes a model's layers use it.

What this module owns:
- `gated_delta_scan`: the recurrence of mlx-lm's ops path (`mlx_lm.models.gated_delta.gated_delta_ops`), the same
  compiled step in the same order, so its forward values are bitwise those of the ops path. It is an
  `mx.custom_function` whose forward keeps only the state at chunk boundaries (~sqrt(T) of them) and whose
  hand-written VJP recomputes one chunk's states at a time and runs the recurrence backwards through it.
- `chunked_gated_delta`: the same recurrence for a scalar gate (Qwen3.5, Qwen3-Next) in the chunked WY form
  (below): matmuls over 64-token chunks, equal to the ops path to float rounding (on CUDA, where MLX runs
  float32 matmuls in TF32 by default, to ~1e-4 relative at Qwen3.5's shapes: below bf16's own rounding).
- `bounded_gated_delta_update`: a drop-in for mlx-lm's `gated_delta_update` (same gates, same signature): the
  chunked form for scalar gates, the bounded scan otherwise.
- `bounded_scan(model)`: while active in the current thread (a ContextVar), gated-delta layers of the classes
  `model` uses call `bounded_gated_delta_update`; other threads are untouched; a no-op for models without them.

Why: autograd through the ops path keeps several [B, H, Dv, Dk] float32 states per token (a peer measured 34.3 GiB
for one Qwen3.5-0.8B layer at 4,096 tokens). MLX runs each node as late as its consumers allow, so the scan pins
its schedule with mx.depends (see below); without that even a chunked backward holds every state. And the
Metal kernel that mlx-lm runs in eval mode on a Mac GPU (`mx.fast.metal_kernel`) has no VJP at all: differentiating
it raises "[Primitive::vjp] Not implemented for CustomKernel". mlx_lm.load returns models in eval mode, so
without this, training such a model on a Mac GPU fails.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import sys
import threading

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gated_delta as _ref

# The ops path's compiled step: calling the very same function (not a copy) keeps the forward bit-identical.
_step = _ref._gated_delta_step_ops


@mx.compile
def _step_vjp(q, k, v, g, beta, s0, dy, ds, mask=None):
    """Backward of one `_step` from its input state s0: cotangents (dy of y, ds of the new state) ->
    (dq, dk, dv, dg, dbeta, ds0), all float32. Recomputes the step's intermediates from s0 (cheap, elementwise)."""
    decay = g[..., None, None] if g.ndim == 2 else g[..., None, :]
    kk = k[..., None, :]
    s1 = s0 * decay
    err = v - (s1 * kk).sum(axis=-1)  # v - kv_mem
    delta = err * beta[..., None]
    s2 = s1 + kk * delta[..., None]
    dy = dy.astype(mx.float32)
    if mask is not None:  # a masked-out step keeps the old state, but y is still read from s2 (as in the ops path)
        m = mask[:, None, None, None]
        ds_skip, ds = mx.where(m, 0.0, ds), mx.where(m, ds, 0.0)
    ds2 = ds + dy[..., None] * q[..., None, :]  # y = s2 @ q
    dq = (s2 * dy[..., None]).sum(axis=-2)
    ddelta = (ds2 * kk).sum(axis=-1)
    dv = ddelta * beta[..., None]
    dbeta = (ddelta * err).sum(axis=-1)
    ds1 = ds2 - dv[..., None] * kk  # through kv_mem = s1 @ k (d kv_mem = -dv)
    dk = (ds2 * delta[..., None]).sum(axis=-2) - (s1 * dv[..., None]).sum(axis=-2)
    dg = (ds1 * s0).sum(axis=(-2, -1)) if g.ndim == 2 else (ds1 * s0).sum(axis=-2)
    ds0 = ds1 * decay
    if mask is not None:
        ds0 = ds0 + ds_skip
    return dq, dk, dv, dg, dbeta, ds0


def _chunk_size(T: int) -> int:
    # Memory is (T / chunk) boundary states + chunk recomputed states: smallest near sqrt(T) (64 at 4,096 tokens).
    return max(8, math.ceil(math.sqrt(T)))


@functools.lru_cache(maxsize=None)
def _scan_fn(chunk: int, masked: bool):
    """The custom function for one chunk size, with or without a mask (its primals are arrays only)."""

    @mx.custom_function
    def scan(q, k, v, g, beta, state, *mask):
        m = mask[0] if masked else None
        ys, bounds = [], []
        for t in range(q.shape[1]):
            if t % chunk == 0:
                bounds.append(state)
            y, state = _step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, None if m is None else m[:, t])
            # MLX schedules each node as late as its consumers allow; y's consumer is the final stack, so without
            # this edge every y (and the full state it reads) would wait for the end of the scan: all T states live.
            state = mx.depends(state, y)
            ys.append(y)
        return mx.stack(ys, axis=1), state, mx.stack(bounds)

    @scan.vjp
    def scan_vjp(primals, cotangents, outputs):
        q, k, v, g, beta, state = primals[:6]
        m = primals[6] if masked else None
        dy, ds, _ = cotangents
        bounds = outputs[2]
        T = q.shape[1]
        grads = [[None] * T for _ in range(5)]
        for c in reversed(range(bounds.shape[0])):
            start, end = c * chunk, min(T, (c + 1) * chunk)
            # Recompute this chunk only once the gradient from the later chunks is there; otherwise the scheduler
            # may recompute every chunk up front and hold all their states at once.
            s = mx.depends(bounds[c], ds)
            states = []
            for t in range(start, end):
                states.append(s)
                _, s = _step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s, None if m is None else m[:, t])
            for t in reversed(range(start, end)):
                *step_grads, ds = _step_vjp(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], states[t - start],
                                            dy[:, t], ds, None if m is None else m[:, t])
                # Same scheduling reason: make the per-token gradients (reductions of full states) run now.
                ds = mx.depends(ds, step_grads)
                for i, d in enumerate(step_grads):
                    grads[i][t] = d
        out = [mx.stack(gs, axis=1).astype(p.dtype) for gs, p in zip(grads, (q, k, v, g, beta))]
        out.append(ds.astype(state.dtype))
        if masked:
            out.append(mx.zeros_like(m))
        return tuple(out)

    return scan


def gated_delta_scan(q, k, v, g, beta, state=None, mask=None, chunk: int | None = None):
    """Drop-in for mlx-lm's `gated_delta_ops` (same shapes, same forward values) whose backward keeps only the
    state at chunk boundaries. q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; g: [B, T, Hv] or [B, T, Hv, Dk];
    beta: [B, T, Hv]; state: [B, Hv, Dv, Dk]; mask: [B, T] bool. -> (y [B, T, Hv, Dv], state)."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if (repeat_factor := Hv // Hk) > 1:  # as the ops path: autograd sums the repeated heads' gradients back
        q = mx.repeat(q, repeat_factor, -2)
        k = mx.repeat(k, repeat_factor, -2)
    fn = _scan_fn(chunk or _chunk_size(T), mask is not None)
    y, state, _ = fn(q, k, v, g, beta, state, *(() if mask is None else (mask,)))
    return y, state


def bounded_gated_delta_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *, use_kernel: bool = True,
                               lower_bound: float | None = None, allow_neg_eigval: bool = False):
    """mlx-lm's `gated_delta_update` with the scan replaced by `chunked_gated_delta` (scalar gates: Qwen3.5,
    Qwen3-Next) or `gated_delta_scan` (vector gates, single steps). `use_kernel` is accepted and ignored: the
    Metal kernel has no VJP, and the ops path's values (to float rounding) are the contract here."""
    beta = mx.sigmoid(b)
    if allow_neg_eigval:
        beta = beta * 2.0
    if a.ndim == 3 and q.shape[1] > 1:  # a scalar gate: the chunked form (its matmuls run in parallel)
        # the gate's log straight from its formula: g itself underflows to 0 in float32 once
        # A * softplus(a + dt_bias) > ~87, and log(0) would turn every later token into NaN
        rate = mx.exp(A_log.astype(mx.float32))
        if lower_bound is None:
            log_g = -rate * nn.softplus(a.astype(mx.float32) + dt_bias)
        else:
            log_g = lower_bound * mx.sigmoid(rate * (a.astype(mx.float32) + dt_bias))
        return chunked_gated_delta(q, k, v, log_g, beta, state, mask)
    if lower_bound is None:
        g = _ref.compute_g(A_log, a, dt_bias)
    else:
        g = _ref.compute_lower_bound_g(A_log, a, dt_bias, lower_bound)
    return gated_delta_scan(q, k, v, g, beta, state, mask)


# --- the scoped switch -----------------------------------------------------------------------------------------
# mlx-lm's layers call the name `gated_delta_update` from their own module's globals. While any bounded_scan is
# open, that name is a dispatcher which picks the bounded scan only in a context (thread) where one is active; other
# threads running the same model keep mlx-lm's original (kernel for inference). The last exit restores the name.
_ACTIVE = contextvars.ContextVar("mlx_grpo_bounded_gated_delta", default=False)
_LOCK = threading.Lock()
_INSTALLED: dict[str, tuple[object, int]] = {}  # module name -> (original function, open contexts)


def _dispatcher(original):
    @functools.wraps(original)
    def gated_delta_update(*args, **kwargs):
        return (bounded_gated_delta_update if _ACTIVE.get() else original)(*args, **kwargs)

    gated_delta_update._mlx_grpo_original = original
    return gated_delta_update


def _gated_delta_modules(model) -> list[str]:
    """Names of the modules defining `model`'s gated-delta layer classes (every one keeps an A_log) whose
    globals hold mlx-lm's gated_delta_update."""
    names = set()
    for layer in model.modules() if isinstance(model, nn.Module) else []:  # plain callables hold no layers
        if "A_log" not in layer:
            continue
        name = type(layer).__module__
        fn = getattr(sys.modules.get(name), "gated_delta_update", None)
        if fn is not None and getattr(fn, "_mlx_grpo_original", fn) is _ref.gated_delta_update:
            names.add(name)
    return sorted(names)


@contextlib.contextmanager
def bounded_scan(model):
    """While active (in this thread/context), `model`'s gated-delta layers use bounded_gated_delta_update: the
    chunked form (scalar gates) or the bounded scan, the ops path's values to float rounding, backward memory O(T)
    values instead of T states. A no-op for models without such layers. Also
    usable as a decorator; the context must be active wherever the layer's forward runs, including a gradient
    checkpoint's recompute during the backward pass."""
    names = _gated_delta_modules(model)
    if not names:
        yield
        return
    with _LOCK:
        for name in names:
            module = sys.modules[name]
            original, count = _INSTALLED.get(name, (module.gated_delta_update, 0))
            if count == 0:
                module.gated_delta_update = _dispatcher(original)
            _INSTALLED[name] = (original, count + 1)
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        with _LOCK:
            for name in names:
                original, count = _INSTALLED[name]
                if count == 1:
                    sys.modules[name].gated_delta_update = original
                    del _INSTALLED[name]
                else:
                    _INSTALLED[name] = (original, count - 1)


# --- the chunked (parallel) form -------------------------------------------------------------------------------
# The per-token scan is T sequential steps of a few small kernels: on a GPU the host's dispatch bounds it (~300x an
# attention layer's time at 4,096 tokens on an H200). Within a chunk of C tokens the recurrence has a closed form
# (the WY representation of Yang et al. 2024, "Gated Delta Networks", as flash-linear-attention computes it): with
# G_t the log of the decay accumulated inside the chunk and S0 the state entering it,
#   u = (I + A)^-1 (beta v - beta e^G k S0^T),   A_ij = beta_i e^(G_i - G_j) k_i.k_j  (j < i)
#   y_t = e^G_t S0 q_t + sum_{i<=t} e^(G_t - G_i) (q_t.k_i) u_i,   S_C = e^G_C S0 + sum_i e^(G_C - G_i) u_i k_i^T
# so only the T / C chunk-to-chunk steps are sequential, each a few matmuls; autograd keeps O(T) values, not T states.
CHUNK = 64


_BLOCK = 16  # the diagonal blocks inverted by substitution


def _unit_lower_inverse(a: mx.array) -> mx.array:
    """(I + a)^-1 for strictly lower-triangular a [..., C, C] (C = 16 * 2^m): 16x16 diagonal blocks by forward
    substitution, then blocks merged pairwise, inv [[L1, 0], [M, L2]] = [[L1^-1, 0], [-L2^-1 M L1^-1, L2^-1]].
    Every product is of true sub-inverses, which stay bounded where the state does; the power series
    sum_k (-a)^k does not (its terms overflow float32 for keys that point alike)."""
    C = a.shape[-1]
    shape = a.shape
    a = a.reshape(-1, C, C)  # one leading axis: the block reshapes below stay under MLX's 10 dimensions
    lead = a.shape[:-2]
    b = min(C, _BLOCK)
    blocks = a.reshape(*lead, C // b, b, C // b, b)
    idx = mx.arange(C // b)
    diag = blocks[..., idx, :, idx, :]  # [nb, ..., b, b]: the diagonal blocks (advanced indices lead)
    eye = mx.eye(b, dtype=a.dtype)
    rows = [mx.broadcast_to(eye[0], diag.shape[:-1][:-1] + (b,))]
    for i in range(1, b):
        # a multiply-and-sum, not a matmul: CUDA runs float32 matmuls in TF32, which the substitution would compound
        rows.append(eye[i] - (diag[..., i, :i, None] * mx.stack(rows, axis=-2)).sum(axis=-2))
    inv = mx.stack(rows, axis=-2)  # [nb, ..., b, b]
    inv = mx.moveaxis(inv, 0, -3)  # [..., nb, b, b]
    size = b
    while size < C:
        pairs = C // (2 * size)
        inv = inv.reshape(*lead, pairs, 2, size, size)
        l1, l2 = inv[..., 0, :, :], inv[..., 1, :, :]
        idx = mx.arange(pairs)
        # each pair's lower-left block M: rows of its second half, columns of its first
        m = mx.moveaxis(a.reshape(*lead, pairs, 2, size, pairs, 2, size)[..., idx, 1, :, idx, 0, :], 0, -3)
        top = mx.concatenate([l1, mx.zeros_like(l1)], axis=-1)
        bottom = mx.concatenate([-(l2 @ m @ l1), l2], axis=-1)
        inv = mx.concatenate([top, bottom], axis=-2)  # [..., pairs, 2 size, 2 size]
        size *= 2
    return inv.reshape(shape)


def chunked_gated_delta(q, k, v, log_g, beta, state=None, mask=None, chunk: int = CHUNK):
    """gated_delta_ops' recurrence for a scalar gate in the chunked form above (float32 inside): the same values up
    to float rounding. q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; log_g (the gate's log), beta: [B, T, Hv];
    state: [B, Hv, Dv, Dk]; mask: [B, T] bool (a masked step leaves the state as it was; its y, read before the
    write, belongs to a pad token nobody reads). chunk: 16 * 2^m (the block inverse halves it down to 16).
    -> (y [B, T, Hv, Dv] in q's dtype, state)."""
    if chunk > _BLOCK and chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two, got {chunk}")
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    out_dtype = q.dtype
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if (repeat_factor := Hv // Hk) > 1:
        q, k = mx.repeat(q, repeat_factor, -2), mx.repeat(k, repeat_factor, -2)
    log_g = log_g.astype(mx.float32)
    beta = beta.astype(mx.float32)
    if mask is not None:  # no decay and no write: the state passes the step unchanged
        log_g, beta = mx.where(mask[..., None], log_g, 0.0), mx.where(mask[..., None], beta, 0.0)
    pad = -T % chunk
    n = (T + pad) // chunk

    def chunks(x):  # [B, T, H, ...] -> [B, H, n, C, ...] in float32, zero-padded at the end
        x = x.astype(mx.float32)
        if pad:
            x = mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(B, n, chunk, *x.shape[2:])
        return mx.moveaxis(x, 3, 1)

    q, k, v, log_g, beta = map(chunks, (q, k, v, log_g, beta))  # q, k [B,H,n,C,Dk]; v [..,Dv]; log_g, beta [B,H,n,C]
    cum = mx.cumsum(log_g, axis=-1)  # G_t inside each chunk
    causal = mx.tril(mx.ones((chunk, chunk), dtype=mx.bool_))
    strict = mx.tril(mx.ones((chunk, chunk), dtype=mx.bool_), k=-1)
    gap = cum[..., :, None] - cum[..., None, :]  # G_i - G_j
    decay_in = mx.exp(mx.where(causal, gap, -mx.inf))  # e^(G_i - G_j) for j <= i, else 0
    kb = k * beta[..., None]
    a = (kb @ mx.swapaxes(k, -1, -2)) * mx.where(strict, decay_in, 0.0)
    inv = _unit_lower_inverse(a)
    u_free = inv @ (v * beta[..., None])  # [.., C, Dv]: u when S0 = 0
    w = inv @ (kb * mx.exp(cum)[..., None])  # [.., C, Dk]: u's dependence on S0 is -w S0^T
    attn = (q @ mx.swapaxes(k, -1, -2)) * decay_in  # [.., C, C]
    q_in = q * mx.exp(cum)[..., None]
    k_out = k * mx.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = mx.exp(cum[..., -1])[..., None, None]  # [B, H, n, 1, 1]
    s = state.astype(mx.float32)
    ys = []
    for c in range(n):
        u = u_free[:, :, c] - w[:, :, c] @ mx.swapaxes(s, -1, -2)  # [B, H, C, Dv]
        ys.append(q_in[:, :, c] @ mx.swapaxes(s, -1, -2) + attn[:, :, c] @ u)
        s = chunk_decay[:, :, c] * s + mx.swapaxes(u, -1, -2) @ k_out[:, :, c]
    y = mx.stack(ys, axis=2).reshape(B, Hv, n * chunk, Dv)[:, :, :T]
    return mx.moveaxis(y, 1, 2).astype(out_dtype), s
