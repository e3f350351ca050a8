"""Where a rollout's decode loop spends its time (bench/tools_bench.py --phases, --train-minutes): each of the loop's
parts (refills, admissions, turns handed over, stop checks, the rows kept between syncs) timed to the device's end
or on the host alone, patched in around the engine's own functions for the length of a `with`, and a trainer's run
with every rollout's parts timed the same way."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx

# The decode loop's parts --phases times to the device's end: label -> (module, class, method)
PHASES = {"decode loop (all)": ("loop", None, "decode_rows"), "first prefill": ("copy_decoder", "CopyDecoder", "begin"),
          "finish rows": ("loop", None, "finish_rows"), "refill: compact": ("copy_decoder", "CopyDecoder", "select"),
          "refill: admit": ("copy_decoder", "CopyDecoder", "admit"),
          "refill: admit in place": ("copy_decoder", "CopyDecoder", "admit_into"),
          "turns: report": ("turns", "TurnRows", "report"), "turns: take": ("turns", "TurnRows", "take"),
          # within report: the gather of the kept blocks (the rest of report is host work)
          "turns: keep blocks": ("turns", "TurnRows", "keep_blocks"),
          "rows at syncs": ("columns", "Written", "update"), "stop checks": ("columns", "StopRows", "stopped")}


@contextmanager
def phase_times(synchronize: bool = True):
    """Within: each of PHASES timed from the device's idle to its end (mx.synchronize on both sides); the loop's
    wait at a sync (its mx.eval: the device finishing the steps queued since the last sync), the decode step's
    dispatch and its mx.async_eval timed on the host alone (on a GPU their device time lands in the next sync's
    wait; on a CPU async_eval computes the step), and each refill's batch, admitted rows and cache capacity. The
    synchronizations take away some overlap: the total is not an unprofiled run's. Yields the record, filled as the
    loop runs: {label: [seconds, calls]}, "admits": [(batch rows, admitted rows, capacity, in place, rows resuming
    a turn, seconds)].
    synchronize=False: each part on the host alone, the device's work left to overlap it as unprofiled."""
    import importlib

    import mlx_grpo.rollout.loop as loop

    timer = {label: [0.0, 0] for label in [*PHASES, "sync wait", "step dispatch", "step async_eval"]}
    timer["admits"] = []
    undo = []

    def timed_call(label, fn, synchronize=True):
        def wrapper(*a, **k):
            if synchronize:
                mx.synchronize()
            t0 = time.perf_counter()
            result = fn(*a, **k)
            if synchronize:
                mx.synchronize()
            timer[label][0] += time.perf_counter() - t0
            timer[label][1] += 1
            return result
        return wrapper

    for label, (module, cls, name) in PHASES.items():
        owner = importlib.import_module(f"mlx_grpo.rollout.{module}")
        owner = owner if cls is None else getattr(owner, cls)
        if cls is None:  # a module function: patched where the engine imported it
            import mlx_grpo.rollout.engine as owner
        undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, timed_call(label, getattr(owner, name), synchronize))
    decoder_cls = importlib.import_module("mlx_grpo.rollout.copy_decoder").CopyDecoder
    undo.append((decoder_cls, "step", decoder_cls.step))
    decoder_cls.step = timed_call("step dispatch", decoder_cls.step, synchronize=False)
    admit, admit_into = decoder_cls.admit, decoder_cls.admit_into

    def record(self, entries, in_place: bool, call):  # the batch (after compaction), its rows, the seconds
        batch, capacity, t0 = int(self.keys.shape[1]), int(self.keys.shape[3]), time.perf_counter()
        out = call()
        timer["admits"].append((batch, sum(e[2] for e in entries), capacity, in_place,
                                sum(e[2] for e in entries if e[3] is not None), time.perf_counter() - t0))
        return out

    def recorded_admit(self, entries, T):  # rows appended to the batch
        return record(self, entries, False, lambda: admit(self, entries, T))

    def recorded_admit_into(self, slots, entries):  # rows written into done rows' slots
        return record(self, entries, True, lambda: admit_into(self, slots, entries))
    decoder_cls.admit, decoder_cls.admit_into = recorded_admit, recorded_admit_into

    class LoopMx:  # the loop's mx with its sync's eval timed (the device finishing the steps queued since the last)
        eval = staticmethod(timed_call("sync wait", mx.eval, synchronize=False))
        async_eval = staticmethod(timed_call("step async_eval", mx.async_eval, synchronize=False))

        def __getattr__(self, name):
            return getattr(mx, name)
    undo.append((loop, "mx", loop.mx))
    loop.mx = LoopMx()
    try:
        yield timer
    finally:
        for owner, name, fn in reversed(undo):
            setattr(owner, name, fn)


def train_phases(cfg, synchronize: bool = True) -> dict:
    """`mlx-grpo train` of cfg with the decode loop's parts timed (phase_times) in each of its rollouts (decode
    passes): per pass, its seconds, rows, decode steps and each part's seconds and calls; and the run's metrics.
    What a trainer's pass spends beside what the bench's (profiled) pass does. Times the engine of the trainer's
    own process (synchronize: as phase_times'): in-run evaluation's passes would count among them
    (eval_every_updates = 0 keeps them out), and rollout_worker = process decodes elsewhere (nothing recorded)."""
    from mlx_grpo.commands.train import train
    from mlx_grpo.rollout.engine import RolloutEngine

    passes, fused = [], RolloutEngine._generate_fused

    def timed_pass(self, jobs, G, *a, **k):  # each rollout's parts: the timer's growth over it
        before = {label: tuple(v) for label, v in timer.items() if isinstance(v, list) and label != "admits"}
        mx.synchronize()
        t0 = time.perf_counter()
        out = fused(self, jobs, G, *a, **k)
        mx.synchronize()
        passes.append({"seconds": time.perf_counter() - t0, "rows": sum(len(p) for p, _ in jobs) * G,
                       "decode_steps": self.steps,
                       "parts": {label: round(timer[label][0] - s, 4) for label, (s, _) in before.items()},
                       "calls": {label: timer[label][1] - n for label, (_, n) in before.items()}})
        return out

    RolloutEngine._generate_fused = timed_pass
    try:
        with phase_times(synchronize) as timer:
            run_dir = train(cfg)
    finally:
        RolloutEngine._generate_fused = fused
    metrics = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {"updates": len(metrics), "passes": passes,
            "metrics": [{k: m.get(k) for k in ("time_rollout_s", "decode_passes", "draws", "time_step_s",
                                               "completion_length_mean", "tool_calls_mean")} for m in metrics]}
