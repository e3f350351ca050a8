"""The rollout engine: the one place that turns prompts into sampled completions (Rollout records).

It owns the sampling copy of the policy (models/decoder.py: fused projections, adapters merged, the
compute dtype), refreshed by the trainer after every optimizer update, and its compiled decode steps. Rows
decode through the one decode loop (loop.decode_rows) over the copy (copy_decoder.CopyDecoder): each step is
one compiled graph (the model's step plus sampling, writing the KV cache in place where the fused CUDA kernel
serves), and rows that have
ended are dropped from the batch once at most half of it is still live (the batch shrinks to the next power of
two, so few shapes are ever compiled). generate_many decodes an update's batch steps together: the first
step's prompts (or as many as `rows`, running_rows, holds) start the batch, the later ones are prefilled into
the slots ended rows free (refill), so one long row no longer holds a batch step. A row's tokens depend on its
own key and context, so which rows share its batch leaves them unchanged (exactly so on a CPU in float32; see
below for a GPU).

Models the copy does not cover (other families, quantized weights: QLoRA bases and
quantize_for_rollouts, whose memory saving the copy would undo), and every model under rollout_engine =
model (the default off CUDA), decode through decode.py's generate_rollout on the model itself (the same loop
over a loop.ModelDecoder, one batch step at a time).
Compaction and refill change the matmuls' row count, which on a GPU in bfloat16 can move a logit's last
bits: a row's tokens then depend on its key, its context and, at a near-tie, on the batch around it (on the
H100, 89% of rows kept their text when 4 batch steps were refilled rather than decoded one by one); a
resumed run replays the same batches and reproduces the same tokens.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_grpo.models import compiled_decode, decoder
from mlx_grpo.kernels import available as kernel_available
from mlx_grpo.rollout.copy_decoder import CopyDecoder
from mlx_grpo.rollout.decode import check_batch_caches, generate_rollout
from mlx_grpo.rollout.loop import check_lookahead, decode_rows, finish_rows
from mlx_grpo.rollout.rollout_records import Rollout, SamplingParams
from mlx_grpo.rollout.sampler import closing_tokens, end_ids, sample
from mlx_grpo.rollout.turns import TurnRows


def _quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())


def uses_copy(mode: str, model: nn.Module) -> bool:
    """Whether rollout_engine = mode samples `model` through the sampling copy (auto: on NVIDIA GPUs)."""
    wanted = mode == "copy" or (mode == "auto" and kernel_available())
    return wanted and decoder.supports(model) and not _quantized(model)


def check_rollout_model(mode: str, model: nn.Module) -> str | None:
    """Raise UserError (one line naming the family) when the decode cannot batch the caches this model asks
    for. -> a warning line when rollout_engine = copy was asked for a model the copy does not serve (it then
    decodes on the model itself), else None."""
    check_batch_caches(model)
    if mode != "copy" or uses_copy(mode, model):
        return None
    why = "its weights are quantized" if _quantized(model) else \
        f"model family {getattr(model, 'model_type', type(model).__name__)!r} is not one it serves"
    return (f"rollout_engine = copy serves unquantized {', '.join(sorted(decoder.FAMILIES))} models with full "
            f"attention; {why}: rollouts decode on the model itself (rollout_engine = model)")


def first_prompts(prompts: int, first_job: int, G: int, rows: int) -> int:
    """The prompts the copy's running batch starts with, of `prompts` in a decode whose first batch step has
    first_job: as many as `rows` (running_rows) holds, at least one; 0 rows: the first step's."""
    return min(prompts, max(1, rows // G)) if rows else first_job


class RolloutEngine:
    """Samples rollouts from the policy it was last refreshed with.

    mode: rollout_engine (copy, model or auto: the copy on NVIDIA GPUs). compact: drop ended rows from the
    batch (False: every row decodes to the end, for comparisons). graph: decode_graph, the copy's step with
    fewer primitives (models/compiled_decode.py). keep_turn_cache: a row's next turn prefills only what its
    kept cache lacks (rollout/turns.py); False: its whole context again (for comparisons). write_in_step: where
    the fused CUDA kernel serves, it writes each token's keys/values into the cache in place; False: the loop
    writes them outside the step, which copies the cache every step (for comparisons). admit_in_place: a refill
    writes the rows it admits into done rows' slots where the batch keeps its size; False: it rebuilds the batch
    (a copy of the cache, for comparisons). turn_wait: one-row entries (rows' next turns; prompts of one sample)
    join once target // turn_wait slots of the running batch are free, at least one (loop.decode_rows; the same
    tokens, other admissions). lookahead: the copy's syncs read the rows as they were that many steps before them,
    their host work able to run while those steps are on the device (loop.decode_rows; the same tokens, later
    admissions). turn_wait and lookahead shape the sampling copy's loop; the model path ignores them.
    """

    def __init__(self, tokenizer, *, mode: str = "auto", compact: bool = True, sync_every: int = 8,
                 graph: bool = False, keep_turn_cache: bool = True, write_in_step: bool = True,
                 admit_in_place: bool = True, rows: int = 0, turn_wait: int = 8, lookahead: int = 0):
        self.tokenizer = tokenizer
        self.rows = rows
        self.mode = mode
        self.compact = compact
        if sync_every < 1 or turn_wait < 1:
            raise ValueError(f"sync_every {sync_every}, turn_wait {turn_wait}: each must be at least 1")
        check_lookahead(lookahead, sync_every)
        self.sync_every = sync_every
        self.turn_wait, self.lookahead = turn_wait, lookahead
        self.graph = graph
        self.keep_turn_cache = keep_turn_cache
        self.write_in_step = write_in_step
        self.admit_in_place = admit_in_place
        self.traces = 0  # times a decode step was traced (compiled): once per batch shape and cache capacity
        self.model = None
        self._serves = False  # whether the copy serves self.model (uses_copy), decided when it arrives
        self._copy = None  # (spec, weights), built on first use after each refresh
        self._stale = False
        self._steps = {}
        self.row_steps = 0  # rows x decode steps the last fused rollout computed (what compaction saves)
        self.steps = 0  # decode steps it ran (what refill saves: a step costs about the same at any row count)
        self.prefilled_tokens = 0  # context tokens the last fused rollout prefilled (what kept turn caches save)
        self._closing = {}  # stop strings -> sampler.closing_tokens' table (a scan of the vocabulary, once)

    def refresh(self, model: nn.Module) -> "RolloutEngine":
        """Sample from `model`'s current weights from now on. The copy is rebuilt when next needed, so
        several updates between two rollouts (num_iterations > 1) and a resume build it once. Whether the copy
        serves `model` is decided once per model object (its family and quantization do not change under it)."""
        if model is not self.model:
            self._serves = uses_copy(self.mode, model)
        self.model = model
        self._copy = None  # free the old copy now: its memory is the new one's
        self._stale = self._serves
        return self

    def _current(self):
        if self._stale:
            # its compute dtype is the embedding's (quantized models never get a copy)
            self._copy = decoder.build(self.model, self.model.model.embed_tokens.weight.dtype)
            if self.graph:  # its matrices stored transposed, as compiled_decode's step reads them
                self._copy = (self._copy[0], compiled_decode.graph_weights(self._copy[1]))
            self._stale = False
        return self._copy

    @property
    def uses_copy(self) -> bool:
        return self._current() is not None

    @property
    def spec(self):
        return self._current()[0]

    @property
    def weights(self) -> dict:
        return self._current()[1]

    def generate(self, prompts: list[list[int]], group_size: int, params: SamplingParams, key: mx.array,
                 prefill_text: str = "", on_stop=None, limits: np.ndarray | None = None) -> Rollout:
        """G completions for each of the B prompts. key: one key (split into the N = B*G row keys) or the row
        keys themselves, [N, 2]. limits [N]: tokens each row may write at most (its columns past that are
        not decoded for it, when the batch goes on for others)."""
        keys = key if key.ndim == 2 else mx.random.split(key, len(prompts) * group_size)
        return self.generate_many([(prompts, keys)], group_size, params, prefill_text, on_stop, limits)[0]

    def generate_many(self, jobs: list[tuple[list[list[int]], mx.array]], group_size: int, params: SamplingParams,
                      prefill_text: str = "", on_stop=None, limits: np.ndarray | None = None,
                      turns=None, on_done=None) -> list[Rollout] | None:
        """The rollouts of several batch steps, jobs = [(prompts, row keys [B*G, 2])], decoded together: the
        first job fills the batch, and when rows end, the next jobs' prompts take their slots (refill), so
        one long row no longer holds a batch step. Each row samples the tokens generate() gives it alone.
        on_stop(row, ids): called during decoding with each row (numbered over all jobs) seen stopped by a
        stop string, and its ids up to the stop; it may be called again for the same row. limits: as
        generate's, over all jobs' rows.

        turns (the sampling copy only; multiturn.py): rows go on in later turns inside this decode. At each
        of the loop's syncs the engine calls turns.ended(row, ids, logprobs, entropies) for every row that
        is done (its end token, a stop string or its limit; the tokens it wrote, which may run past that),
        -> how many of ids its context keeps, or None when its episode ended; and turns.take(n) for the next
        turns of the rows ended at earlier syncs: ([(context ids, limit, the row it continues)], their keys
        [turns, 2] or None), rows numbered n, n + 1, ..., decoded in freed slots ahead of later prompts
        (rollout/turns.py). turns.pending() says whether any ended row may still go on. Returns None: the turns
        hold the results.
        on_done(first, done) (not with turns): called at the loop's syncs with done [n] bool, whether rows
        first, ..., first + n - 1 (numbered over all jobs) have ended so far (evaluation's progress bar)."""
        if self.model is None:
            raise RuntimeError("RolloutEngine.generate before refresh(model)")
        if not self.uses_copy:
            if turns is not None:
                raise ValueError("turns need the sampling copy (multiturn.py decodes the model in waves)")
            out, first = [], 0
            for prompts, keys in jobs:
                n = len(prompts) * group_size
                watch = None if on_stop is None else (lambda r, ids, first=first: on_stop(first + r, ids))
                progress = None if on_done is None else partial(on_done, first)
                out.append(generate_rollout(self.model, self.tokenizer, prompts, group_size, params, keys,
                                            prefill_text, sync_every=self.sync_every, on_stop=watch,
                                            limits=None if limits is None else limits[first:first + n],
                                            on_done=progress, closing=self.closing_tokens(params.stop)))
                first += n
            return out
        return self._generate_fused(jobs, group_size, params, prefill_text, on_stop, turns, limits, on_done)

    # ------------------------------------------------------------------ the sampling copy's decode
    def step_fn(self, params: SamplingParams, eos: tuple[int, ...], kernel: bool, write_cache: bool = False):
        """The compiled decode step for these sampling settings (traced once per batch shape). write_cache: the
        fused kernel writes the token's keys/values into the cache itself (decoder.fused_serves)."""
        spec = self.spec
        shape = (spec.heads, spec.kv_heads, spec.head_dim, spec.scale, spec.eps, spec.qk_norm,
                 None if spec.theta is None else tuple(spec.theta.tolist()))
        cache_key = (params.temperature, params.top_p, params.top_k, params.min_p, eos, kernel, shape, self.graph,
                     write_cache)
        if cache_key not in self._steps and self.graph:
            self._steps[cache_key] = compiled_decode.make_step(
                self.spec, lambda logits, keys: sample(logits, keys, params), mx.array(list(eos) or [-1], mx.int32),
                kernel, on_trace=self._traced, write_cache=write_cache)
        if cache_key not in self._steps:  # a refresh with the same shapes keeps the traced step
            spec, eos_array = self.spec, mx.array(list(eos) or [-1], dtype=mx.int32)

            def step(weights, token, keys, values, offset, start, stop, row_keys, ended):
                self._traced()
                logits, new_k, new_v = decoder.decode_step(spec, weights, token, keys, values, offset, start,
                                                           stop, kernel, write_cache)
                token, logprob, entropy = sample(logits, row_keys, params)
                ended = ended | (token[:, None] == eos_array[None]).any(axis=1)
                return token, logprob, entropy, ended, new_k, new_v

            self._steps[cache_key] = mx.compile(step)
        return self._steps[cache_key]

    def closing_tokens(self, stops: tuple[str, ...]) -> np.ndarray | None:
        """sampler.closing_tokens(tokenizer, stops), computed once per stop set."""
        stops = tuple(stops)
        if stops not in self._closing:
            self._closing[stops] = closing_tokens(self.tokenizer, stops)
        return self._closing[stops]

    def _traced(self) -> None:
        self.traces += 1

    def _generate_fused(self, jobs, G: int, params: SamplingParams, prefill_text: str, on_stop=None,
                        turns=None, limits: np.ndarray | None = None, on_done=None) -> list[Rollout] | None:
        """generate_many on the sampling copy: the one decode loop (loop.decode_rows) over a CopyDecoder."""
        spec, weights = self._current()
        eos_ids, pad_id = end_ids(self.tokenizer, params)
        kernel = decoder.kernel_serves(spec)
        writes = self.write_in_step and decoder.writes_in_place(spec)  # in place: no cache copy per step
        copy = CopyDecoder(spec, weights, self.step_fn(params, tuple(eos_ids), kernel, writes), self.graph, pad_id,
                           writes, self.admit_in_place)
        # An entry is a context, the rows it starts and its kept cache: a prompt's G rows, or (turns) one row's
        # next turn; the first prompts fill the batch (the first job's, or as many as `rows` holds), the others
        # wait for freed slots.
        prompts = [p for job, _ in jobs for p in job]
        entries = [(p, g * G, G, None) for g, p in enumerate(prompts)]
        state = None if turns is None else TurnRows(turns, self.keep_turn_cache, [len(e[0]) for e in entries], G,
                                                    wait=not self.lookahead)
        first = first_prompts(len(prompts), len(jobs[0][0]), G, self.rows)
        logits = copy.begin(prompts[:first], [G] * first, params.max_new_tokens)
        out = decode_rows(copy, logits, mx.concatenate([keys for _, keys in jobs]), params, self.tokenizer, eos_ids,
                          pad_id, self.sync_every, entries=entries, compact=self.compact, limits=limits,
                          on_stop=on_stop, on_done=None if on_done is None else partial(on_done, 0), turns=state,
                          closing=self.closing_tokens(params.stop), turn_wait=self.turn_wait,
                          lookahead=self.lookahead)
        self.row_steps, self.steps, self.prefilled_tokens = out.row_steps, out.steps, copy.prefilled_tokens
        if turns is not None:
            return None
        return finish_rows(self.tokenizer, [job for job, _ in jobs], G, out, eos_ids, pad_id, params, prefill_text)
