"""async_rollouts = 1: the next update's rollouts decode in a background thread while this update trains
(rollout_worker = process: the thread hands the decode to a process of its own, rollout/process.py).

Update k trains on batch k while batch k+1 decodes in one worker thread, on that thread's own MLX stream
(MLX releases the GIL while it evaluates, so both threads dispatch at once; on an H100 they still slowed each
other about as much as they overlapped: docs/benchmarks-history.md, ninth sitting), from a frozen snapshot of
the weights update k starts from. Every batch but the first is thus sampled one update stale
(rollout_staleness in metrics.jsonl: the optimizer steps applied since, 1; 0 after a skipped update, which
left the weights as they were); the loss weights that back with rollout_correction (truncated importance
sampling on exp(trainer log-prob - sampler log-prob), the sampler's log-probs recorded during decoding),
which validation requires, as verl's one-step-off-policy and TRL's async GRPO correct it.

One update (PrefetchSteps.next, called by commands/train.py's loop; the step-source interface: step_sources.py):
    join this update's rollouts (or sample them now: the first update, the first after a resume)
    draw and encode the next update's prompts (main thread: the draw counter and data cursor move here only)
    start their decode and reward submission in the thread, from the current weights
    run this update's old/reference log-prob passes (main thread) -> UpdateSteps for Trainer.update

Resume is exact: a checkpoint written after update k, while batch k+1 decodes, records the run's position
from before batch k+1 was drawn (draw counter, prompts cut, data cursor) and the weights that sample it as
the old policy (old_model.safetensors, or old_adapters.safetensors), so the resumed run draws batch k+1
again, with the same keys, from the same weights. Evaluations wait for a pending rollout (both use the
multi-turn state: tools, environment). The thread calls no collective, so data-parallel ranks pipeline
each on its own.
"""

from __future__ import annotations

import copy
import gc
import queue
import threading
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_grpo.data.examples import Example
from mlx_grpo.rollout.engine import RolloutEngine
from mlx_grpo.rollout.multiturn import rollouts
from mlx_grpo.rollout.process import RolloutProcess
from mlx_grpo.training.records import DataPosition, Draw, UpdateSteps
from mlx_grpo.training.sampling import Sampling


@dataclass
class Pending:
    """Rollouts decoding in the thread, and where the run stood before their prompts were drawn."""

    future: Future  # -> list[Draw]
    weights: dict  # the parameters they are sampled from
    applied_at: int  # optimizer steps applied to those weights (counters.applied_updates then)
    draws: int  # counters.draws, counters.prompts_cut and the data cursor before the draw
    prompts_cut: int
    data_cursor: dict


def frozen_view(model):
    """A frozen copy of `model` sharing its arrays (the optimizer replaces the model's arrays, never changes
    them): the thread samples from it while the model trains. Later weights enter by .update()."""
    shared = {id(a): a for _, a in tree_flatten(model.parameters())}
    view = copy.deepcopy(model, memo=shared)
    view.eval()
    view.freeze()
    return view


def serve(jobs: queue.SimpleQueue) -> None:
    """The rollout thread: runs (fn, future) jobs on a stream of its own, forever. It is a daemon and is
    never ended: MLX keeps a compile cache per thread, and a thread that ends runs its destructors, which
    need the GIL; at interpreter exit that aborts the process ("terminate called without an active
    exception"), so the thread stays parked on its queue until the process is gone."""
    stream = mx.new_stream(mx.default_device())  # streams belong to the thread that made them
    while True:
        fn, future = jobs.get()
        with mx.stream(stream):
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)
        fn = future = None  # parked on the queue, the thread must not keep the last job's Trainer alive


class PrefetchSteps:
    """Samples each update's batch steps during the update before it (see the module docstring), over the
    run's sampling stage; total_updates: the last update starts no rollouts after it."""

    exhausted = False  # total_updates is computed from the data: it never runs out first

    def __init__(self, sampling: Sampling, total_updates: int):
        self.sampling, self.total_updates = sampling, total_updates
        s = sampling
        r = s.cfg.rollout
        self.view = self.engine = self.process = None
        if r.rollout_worker == "process":  # decode in a process of its own (rollout/process.py)
            if s.world.size > 1:
                s.world.fail("rollout_worker = process runs one rollout process beside one training process; "
                             "data-parallel runs take rollout_worker = thread")
            self.process = RolloutProcess(s.policies.model, s.tokenizer, r.rollout_engine, r.decode_graph,
                                          r.running_rows)
        else:
            self.view = frozen_view(s.policies.model)
            # Its own engine: the policies' keeps following the trained model (evaluations use it).
            self.engine = RolloutEngine(s.tokenizer, mode=r.rollout_engine, graph=r.decode_graph, rows=r.running_rows)
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=serve, args=(self.jobs,), name="mlx-grpo-rollouts", daemon=True).start()
        self.pending: Pending | None = None
        self.resumed: tuple[dict, int] | None = None  # a checkpoint's sampling weights for the first rollout

    def next(self) -> UpdateSteps | None:
        """This update's batch steps, sampled and through their log-prob passes; starts the next update's.
        None: the data ran out."""
        s = self.sampling
        c = s.counters
        if self.pending is None:
            weights, at = self.resumed or (s.policies.model.parameters(), c.applied_updates)
            self.resumed = None
            if not self.start(weights, at):
                return None
        pending, draws = self.pending, self.pending.future.result()
        self.pending = None
        staleness = c.applied_updates - pending.applied_at  # 0 when the update before was skipped
        if c.update_step + 1 < self.total_updates:  # a later update will train on them
            self.start(s.policies.model.parameters(), c.applied_updates)
        batches = [s.logprob_passes([d]) for d in draws]  # old/reference log-probs, rewards computing meanwhile
        return UpdateSteps(batches, self.position(), staleness)

    def position(self) -> DataPosition:
        """Where the data stood after this update's draws: the pending ones, drawn for the next update, left out."""
        p = self.pending
        if p is None:
            return self.sampling.position()
        c = p.data_cursor
        return DataPosition(c["epoch"] * self.sampling.data.batches_per_epoch + c["position"], c["epoch"],
                            p.prompts_cut)

    def start(self, weights: dict, applied_at: int) -> bool:
        """Draw and encode an update's prompts here, and decode them in the thread from `weights`."""
        s = self.sampling
        before = (s.counters.draws, s.counters.prompts_cut, s.data.state())
        batches = [s.next_examples() for _ in range(s.cfg.training.gradient_accumulation_steps)]
        if any(b is None for b in batches):
            return False
        encoded = [s.encode(examples) for examples in batches]
        # Everything the thread reads is computed here first: a lazy array built on this thread's stream
        # cannot be evaluated on another thread's.
        mx.eval([keys for _, keys, _ in encoded], weights)
        if self.process is None:
            self.view.update(weights)
            self.engine.refresh(self.view)
        future = Future()  # pending before the job is queued: close() reads it to know whether the worker is busy
        self.pending = Pending(future, weights, applied_at, *before)
        self.submit(lambda: self.sample(encoded, weights), future)
        return True

    def submit(self, fn, future: Future | None = None) -> Future:
        future = future or Future()
        self.jobs.put((fn, future))
        return future

    def sample(self, encoded: list[tuple[list[list[int]], mx.array, list[Example]]], weights: dict) -> list[Draw]:
        """The worker thread: decode the batch steps together (refill), here or in the rollout process, and
        submit them for scoring."""
        s, cfg = self.sampling, self.sampling.cfg
        if self.process is not None:  # single-turn only (validation): the episodes' tools live here
            out, seconds = self.process.sample(weights, [(p, k) for p, k, _ in encoded],
                                               cfg.rollout.num_generations, s.params, cfg.data.prefill)
        else:
            t0 = time.perf_counter()
            out = rollouts(self.engine, s.prompts.multiturn, encoded, cfg.rollout.num_generations, s.params,
                           cfg.data.prefill)
            mx.eval([r.arrays for r in out])
            seconds = time.perf_counter() - t0
        share = seconds / len(encoded)  # one decode for all: each step is shown its share
        return [s.submit_rewards(mine, rollout, share) for (_, _, mine), rollout in zip(encoded, out)]

    def wait(self) -> None:
        """Until the pending rollouts are done (their result is kept): evaluations share their tools."""
        if self.pending is not None:
            wait([self.pending.future])

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_state(self, state: dict) -> dict:
        """The trainer state a checkpoint records: with rollouts pending, the position before they were
        drawn, and the update whose weights sample them (`sampling_weights` are saved as the old policy)."""
        p = self.pending
        if p is None:
            return state
        counters = {**state["counters"], "draws": p.draws, "prompts_cut": p.prompts_cut}
        return {**state, "counters": counters, "data_cursor": p.data_cursor, "rollouts_applied_at": p.applied_at}

    @property
    def sampling_weights(self) -> dict | None:
        return None if self.pending is None else self.pending.weights

    def resume(self, weights: dict, state: dict) -> None:
        """A checkpoint written while rollouts were pending: the first rollout samples from its weights."""
        # checkpoints before rollouts_applied_at stored the update index, the same count when none was skipped
        self.resumed = (weights, state.get("rollouts_applied_at", state.get("rollouts_sampled_at")))

    def close(self) -> None:
        """Wait for the thread to finish its rollout (at most one; its result is dropped), then let it drop
        the engine: the engine's compiled steps leave the thread's compile cache only when freed there. A
        rollout process is ended first (killed mid-rollout), so nothing waits on it."""
        if self.process is not None:
            self.process.stop(busy=self.pending is not None and not self.pending.future.done())
        self.wait()
        self.pending = None
        if self.process is not None:
            self.process.release()
            self.process = None
        if self.engine is not None:
            self.submit(self.release).result()

    def release(self) -> None:
        self.engine = self.view = None
        gc.collect()
