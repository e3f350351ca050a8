"""The rollout engine's whole decode step as one compiled function (decode_whole_step = true; model plumbing
for engine.py).

The default step (engine._step_fn) compiles decoder.decode_step and the sampler, and leaves the rest of a
step to the Python loop: the step keys gathered, the RoPE offsets and the cache slot made as arrays, the
new keys/values written into the cache, the step counters advanced (~7 eager operations and their Python
per step). This function does all of that inside the one compiled call, and changes nothing else: the same
weights (decoder.build's layout, no transposed copies) and decoder.decode_step itself, so the same
matmuls and attention kernels run on the same shapes.

State that changes every step is an array input, never a Python number (a Python scalar is frozen into the
trace, and a compile cache keyed on changing scalars grows: mlx #3964): the cache slot [1], each slot's
step counter [n] and its row's step keys [n, T, 2]. So one trace serves every cache length of a capacity;
a new capacity or batch size (compaction, refill) traces again, as the default step does.

The cache write is inside. MLX donates a buffer (writes in place) when the array being overwritten has no
other reference at the moment the update runs; compiling does not change that (measured on CPU, MLX 0.32:
a compiled slice_update of a 128 MB cache costs what the eager one does, ~0.4 ms, the buffer's address
unchanged). What does prevent it is evaluating the updated cache in the same `eval` as the step's
outputs that read the old one: the update may then run before those reads and must copy (~57 ms for the
same cache, eager or compiled). The engine evaluates only the sampled token and its companions; the
cache update runs in the next step's evaluation, after every read of the old cache, and the caller keeps
no reference to the old cache (`keys, values = step(..., keys, values, ...)`). Tests: the engine's tokens
and log-probs with and without it (CPU, float32), one trace per capacity, the buffer written in place.
"""

from __future__ import annotations

import mlx.core as mx

from mlx_grpo.models.decoder import Spec, decode_step


def make_step(spec: Spec, sample, eos: mx.array, kernel: bool, on_trace=None):
    """The compiled step: (weights, token, keys, values, slot, start, kstep, slot_keys, ended) -> (token,
    logprob, entropy, ended, keys, values, slot + 1, kstep + 1), where the fed token [n] is written at cache
    slot `slot` [1] of keys, values [layers, n, Hkv, S, Dh] (returned updated), its RoPE position is
    slot - start[r], and row r samples with slot_keys[r, min(kstep[r], T - 1)] (slot_keys [n, T, 2]: each
    slot's row's step keys). weights: decoder.build's. sample(logits, keys) -> (token, logprob, entropy);
    eos [E] int32 ids that end a row. on_trace() is called each time MLX traces it (to count compilations)."""

    def step(weights, token, keys, values, slot, start, kstep, slot_keys, ended):
        if on_trace is not None:
            on_trace()
        last = slot_keys.shape[1] - 1
        row_keys = mx.take_along_axis(slot_keys, mx.minimum(kstep, last)[:, None, None], axis=1)[:, 0]  # [n, 2]
        logits, new_k, new_v = decode_step(spec, weights, token, keys, values, slot - start, start, slot, kernel)
        token, logprob, entropy = sample(logits, row_keys)
        ended = ended | (token[:, None] == eos[None]).any(axis=1)
        keys = mx.slice_update(keys, new_k, slot, axes=(3,))  # donated: see the module docstring
        values = mx.slice_update(values, new_v, slot, axes=(3,))
        return token, logprob, entropy, ended, keys, values, slot + 1, kstep + 1

    return mx.compile(step)
