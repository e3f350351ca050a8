"""Length-sorted micro-batches of a rollout's rows (at most micro_batch_size rows and micro_batch_tokens padded
tokens), packed for the training forward: the log-prob passes and the gradient pass both run over them, so
full [N, L, V] logits never exist."""

from __future__ import annotations

import mlx.core as mx

from mlx_grpo.models.forward import PackedBatch, bucket, pack, packed_width
from mlx_grpo.rollout.rollout_records import Rollout


def _completion_width(rollout: Rollout, longest: int) -> int:
    """Completion columns of a micro-batch whose longest completion has `longest` tokens: bucketed
    (fewer distinct shapes), never past the rollout's own width."""
    return min(bucket(max(longest, 1)), rollout.completion_ids.shape[1])


def row_chunks(rollout: Rollout, size: int, max_tokens: int = 0, rows: list[int] | None = None) -> list[mx.array]:
    """Row indices (of `rows`, default all) in micro-batches of at most `size` rows and (if max_tokens) at
    most max_tokens padded tokens, counted exactly as chunk_batch/pack() lay them out (bucketed widths);
    longest completions first, so an out-of-memory shows at once. A single row is never split."""
    completion = [int(n) for n in rollout.extents]  # fed context inside a multi-turn completion included
    prompt = [len(p) for p in rollout.row_prompts]
    order = sorted(range(len(completion)) if rows is None else rows, key=lambda r: -completion[r])
    chunks, current, widest_prompt = [], [], 0
    for r in order:
        longest = completion[current[0]] if current else completion[r]  # rows come longest first
        width = packed_width(max(widest_prompt, prompt[r]), _completion_width(rollout, longest))
        padded = (len(current) + 1) * width
        if current and (len(current) == size or (max_tokens and padded > max_tokens)):
            chunks.append(current)
            current, widest_prompt = [], 0
        current.append(r)
        widest_prompt = max(widest_prompt, prompt[r])
    if current:
        chunks.append(current)
    return [mx.array(c) for c in chunks]


def chunk_batch(rollout: Rollout, rows: mx.array, pad_id: int) -> tuple[PackedBatch, int]:
    """The rows packed, cut to their longest completion's bucketed width. -> (batch, width)."""
    width = _completion_width(rollout, max(int(rollout.extents[r]) for r in rows.tolist()))
    prompts = rollout.row_prompts
    return pack([prompts[r] for r in rows.tolist()], rollout.completion_ids[rows, :width],
                rollout.mask[rows, :width], pad_id), width
