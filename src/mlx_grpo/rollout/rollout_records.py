"""The records a rollout hands on: SamplingParams (how to sample) and Rollout (B prompts x G completions:
the sampled ids, masks, sampler log-probs and texts), and select_groups, which builds one Rollout from
chosen groups of others (dynamic sampling, multi-turn waves); and a Rollout's rows in length-sorted micro-batches
(row_chunks: at most micro_batch_size rows and micro_batch_tokens padded tokens) packed for the training forward
(chunk_batch): the log-prob passes and the gradient pass both run over them, so full [N, L, V] logits never exist."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlx_grpo.models.forward import PackedBatch, bucket, pack, packed_width


@dataclass
class SamplingParams:
    max_new_tokens: int
    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # decode all max_new_tokens (equal lengths: benchmarks)


@dataclass
class Rollout:
    """One batch step's samples. N = B*G rows; row r belongs to prompt r // G."""

    prompt_ids: list[list[int]]  # B prompts, as fed to the model
    completion_ids: mx.array  # [N, T] int32 sampled ids; pad_id after each completion's end
    mask: mx.array  # [N, T] float32: 1 for sampled completion tokens (incl. the ending EOS)
    sampler_logprobs: mx.array  # [N, T] float32 log-prob of each sampled id under the sampler's logits/T
    truncated: np.ndarray  # [N] bool: hit max_new_tokens without EOS or stop string
    texts: list[str]  # N texts: prefill + decoded completion (without the ending EOS token)
    group_size: int
    entropies: mx.array | None = None  # [N, T] float32 entropy of the sampler's softmax(logits/T) per token
    # Multi-turn rollouts (multiturn.py): each row's episode, and its number of completion tokens, sampled
    # or fed (mask 0 marks tool output and environment text, which sit inside the completion)
    transcripts: list | None = None
    ends: np.ndarray | None = None
    # [N] bool: rows that are demonstrations (data/demonstrations.py), teacher-forced, not sampled; None: none are
    demo: np.ndarray | None = None

    @property
    def arrays(self) -> list[mx.array]:
        """Its device arrays: what must be evaluated before the rollout leaves the thread or process it ran in."""
        return [self.completion_ids, self.mask, self.sampler_logprobs] + ([] if self.entropies is None
                                                                          else [self.entropies])

    @property
    def row_prompts(self) -> list[list[int]]:
        """The prompt of each of the N rows."""
        return [p for p in self.prompt_ids for _ in range(self.group_size)]

    @property
    def lengths(self) -> np.ndarray:
        """Tokens the model sampled, per row."""
        return np.array(self.mask.sum(axis=1).tolist(), dtype=np.int64)

    @property
    def extents(self) -> np.ndarray:
        """Completion tokens per row, up to and including its last one (fed context included)."""
        return self.ends if self.ends is not None else self.lengths


def select_groups(rollouts: list[Rollout], picks: list[tuple[int, int]], pad_id: int) -> Rollout:
    """One Rollout of the chosen groups, picks = [(rollout index, group index)], in that order; completion
    widths are right-padded to the widest (pad_id, mask 0). Dynamic sampling builds its batch with it."""
    G = rollouts[0].group_size
    T = max([rollouts[i].completion_ids.shape[1] for i, _ in picks], default=1)

    def gather(name: str, fill) -> mx.array:
        parts = []
        for i, g in picks:
            part = getattr(rollouts[i], name)[g * G:(g + 1) * G]  # [G, T_i]
            parts.append(mx.pad(part, [(0, 0), (0, T - part.shape[1])], constant_values=fill))
        return mx.concatenate(parts) if parts else mx.zeros((0, T), dtype=mx.float32)

    rows = [(i, g * G + k) for i, g in picks for k in range(G)]
    return Rollout(prompt_ids=[rollouts[i].prompt_ids[g] for i, g in picks],
                   completion_ids=gather("completion_ids", pad_id).astype(mx.int32), mask=gather("mask", 0.0),
                   sampler_logprobs=gather("sampler_logprobs", 0.0),
                   truncated=np.array([rollouts[i].truncated[r] for i, r in rows], dtype=bool),
                   texts=[rollouts[i].texts[r] for i, r in rows], group_size=G,
                   entropies=gather("entropies", 0.0),
                   transcripts=None if rollouts[0].transcripts is None
                   else [rollouts[i].transcripts[r] for i, r in rows],
                   ends=None if rollouts[0].ends is None
                   else np.array([rollouts[i].ends[r] for i, r in rows], np.int64),
                   demo=None if rollouts[0].demo is None
                   else np.array([rollouts[i].demo[r] for i, r in rows], dtype=bool))


# ------------------------------------------------------------------ micro-batches for the training forward
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
