"""`mlx-grpo train`'s run: the run directory, resume, the update loop with its logs, evaluations and
checkpoints, alone or as one rank of the processes mlx.launch started. The loop reads

    while (steps := job.source.next()):    sample -> rewards submitted -> old/reference log-probs
        trainer.update(steps)              rewards -> advantages -> gradients -> optimizer step

with evaluations, logs and checkpoints around it (training/job.py wires the parts)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import shutil
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from tqdm import tqdm

from mlx_grpo.base.console import console
from mlx_grpo.base.errors import UserError
from mlx_grpo.commands.assembly import build_job, check_prompt_lengths
from mlx_grpo.commands.evaluate import summarize
from mlx_grpo.config import Config, save_json, to_dict
from mlx_grpo.data.examples import Example, subset
from mlx_grpo.reporting.logs import (RunLogger, fmt, merge_ranks, pace, summary_lines, update_record,
                                     updates_left)
from mlx_grpo.reporting.reporters import Reporters, check_installed
from mlx_grpo.storage import checkpoint as ckpt
from mlx_grpo.storage.run_dir import check_writable, prepare_run_dir
from mlx_grpo.training.distributed import init_world
from mlx_grpo.training.job import Job

STARTUP_TIMEOUT = 3600.0  # seconds ranks wait for each other to load (a hub download, a first conversion)


def _evaluate(job: Job, logger: RunLogger, reporters: Reporters, examples: list[Example],
              trigger: str) -> dict | None:
    """Greedy accuracy on `examples`, each rank answering its share; rank 0 logs the whole and returns
    its eval record."""
    cfg, world, policies = job.cfg, job.world, job.trainer.policies
    per = -(-len(examples) // world.size)
    job.source.wait()  # async_rollouts: the next rollouts finish first (they share the tools)
    # the policies' engine samples the trained model itself unless an old policy is kept apart
    engine = policies.engine if policies.sampler is job.model else None
    mine = job.answer(job.model, job.tokenizer, examples[world.rank * per:(world.rank + 1) * per], cfg,
                      max_new_tokens=cfg.eval.eval_max_new_tokens, seed=world.seed(cfg.run.seed),
                      progress=world.is_main, engine=engine, multiturn=job.sampling.prompts.multiturn,
                      system_prompt=job.eval_prompt.system)
    result = summarize([r for part in world.gather(mine, "evaluation") for r in part])
    job.health.observe_eval(job.counters.update_step, result.accuracy, len(examples))  # every rank
    if not world.is_main:
        return None
    record = {"update_step": job.counters.update_step, "batch_step": job.counters.batch_step,
              "trigger": trigger, "accuracy": result.accuracy, "accuracy_lenient": result.lenient_accuracy,
              "format_rate": result.format_rate, "num_examples": len(examples),
              "worked_examples": len(job.eval_prompt.examples)}
    if result.tool_call_rate is not None:
        record["tool_call_rate"] = result.tool_call_rate
    logger.log_eval(record)
    reporters.log_eval(record, record["update_step"])
    return record


def train(cfg: Config, resume: str | None = None) -> Path:
    """Run GRPO as configured (or continue a checkpoint), alone or as one rank of the processes that
    mlx.launch started; returns the run directory."""
    started = time.perf_counter()
    world = init_world(cfg.run.distributed_backend, cfg.run.distributed_timeout)
    if world.is_main:  # rank 0 reports: a missing package stops the run before the model loads
        check_installed(cfg.run.report_to)
    try:  # rank 0 owns the run directory: one that cannot be written stops every rank before the model loads
        error = check_writable(Path(cfg.run.output_dir) / cfg.run.run_name) if world.is_main else None
    except UserError as exc:
        error = str(exc)
    world.agree(error, "the run directory")
    job = build_job(cfg, world)
    try:
        if world.size > 1:
            _check_same_job(job)
            world.print(f"[mlx-grpo] data-parallel over {world.size} ranks: {cfg.training.batch_size // world.size} of "
                        f"{cfg.training.batch_size} prompts per batch step each")
        check_prompt_lengths(job)
        run_dir = _run(job, cfg, resume, started)
    except BaseException:
        job.close(wait=False)  # async_rollouts: the rollout in flight ends (its reward jobs with it)
        raise
    job.close()
    return run_dir


def _fingerprint(job: Job) -> dict:
    """What every rank of a run must share: its settings, its training data, and its model's trainable
    tensors (names, shapes, dtypes, and their sum)."""
    def digest(obj) -> str:
        return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()

    params = tree_flatten(job.model.trainable_parameters())
    total = sum((p.astype(mx.float32).sum() for _, p in params), mx.array(0.0))
    return {"settings": digest(to_dict(job.cfg)),
            "training data": digest([(e.prompt, e.answer, e.columns) for e in job.train_examples]),
            "model": digest([(k, p.shape, str(p.dtype)) for k, p in params]), "weight sum": total.item()}


def _check_same_job(job: Job) -> None:
    """Refuse ranks that would train different things (another config, data file or model revision at the
    same path on another host): their collectives would pair up wrongly or silently mix jobs."""
    world, cfg = job.world, job.cfg
    # Ranks load at different speeds (a first run converts the default model): a long wait is normal.
    timeout = 0 if cfg.run.distributed_timeout == 0 else max(cfg.run.distributed_timeout, STARTUP_TIMEOUT)
    prints = world.gather(_fingerprint(job), "start-up", timeout)
    differ = {}
    for rank, other in enumerate(prints[1:], start=1):
        for key, value in other.items():
            same = math.isclose(value, prints[0][key], rel_tol=1e-5) if key == "weight sum" else value == prints[0][key]
            if not same:
                differ.setdefault(key, []).append(rank)
    if differ:
        world.fail("the ranks do not run the same job: " + "; ".join(
            f"{key} of rank {', '.join(map(str, ranks))} differ from rank 0's" for key, ranks in differ.items())
            + ". Start every rank with the same config, data and model (the same files at the same paths)")


def _resume(job: Job, run_dir: Path, resume: str | None, logger: RunLogger) -> None:
    """Check the run directory and restore a checkpoint. Rank 0 owns the run directory: it reads the
    checkpoint and sends it to the other ranks, whose hosts need no copy. A problem stops every rank."""
    world, error, loaded, path = job.world, None, None, None
    try:
        if world.is_main and resume is None and ckpt.list_checkpoints(run_dir):
            error = (f"run directory {run_dir} already holds checkpoints: pass --resume to continue it, or "
                     "choose another run_name")
        elif world.is_main and resume is not None:
            path, loaded = ckpt.read_for_resume(run_dir, resume, world.print)
            adapters = ckpt.holds_adapters(path)
            changed = ckpt.config_changes(path, job.cfg)
            if loaded[2].get("command") == "sft":  # commands/sft.py's checkpoints: a model to start from
                from mlx_grpo.sft.steps import start_from
                error = (f"--resume: {path} is a checkpoint of `mlx-grpo sft`; to start GRPO from it, "
                         f"{start_from(path, instead_of_resume=True)}")
            elif changed:
                error = (f"--resume: {path} was written with other settings that change the run: "
                         f"{', '.join(changed)}; resume with its config: "
                         f"{ckpt.resume_command('train', path, resume == 'latest')}, or start a new run (another "
                         "run_name). Only logging, eval, saving and timeouts may change")
    except UserError as exc:
        error = str(exc)
    world.agree(error, "resume")
    if resume is None:
        return
    if world.size > 1:
        weights, opt_state, state, old, masters = loaded if world.is_main else (None,) * 5
        path, state, adapters, has_old, has_masters = world.gather(
            (path, state, adapters, old is not None, masters is not None) if world.is_main else None, "resume")[0]
        weights = world.broadcast_arrays(weights, "sending the checkpoint")
        opt_state = _tree(world.broadcast_arrays(_flat(opt_state), "sending the checkpoint"))
        old = _tree(world.broadcast_arrays(_flat(old), "sending the checkpoint")) if has_old else None
        masters = world.broadcast_arrays(masters, "sending the checkpoint") if has_masters else None
        loaded = (weights, opt_state, state, old, masters)
    error = None
    try:
        job.restore(path, loaded, adapters)
    except UserError as exc:  # the same checkpoint and config everywhere: every rank finds the same problem
        error = str(exc)
    world.agree(error, "resume")
    job.resumed = (path, job.counters.update_step)
    if world.is_main:
        logger.truncate_after(job.counters.update_step)
        for name in ckpt.set_aside_later(run_dir, job.counters.update_step):
            world.print(f"[mlx-grpo] {name}: a checkpoint after the resumed one, moved aside so that a later "
                        "--resume cannot return to the abandoned branch")
    world.print(f"[mlx-grpo] resumed from {path} at update {job.counters.update_step}")


def _flat(tree) -> dict | None:
    return None if tree is None else dict(tree_flatten(tree))


def _tree(flat: dict):
    return tree_unflatten(list(flat.items()))


def _run(job: Job, cfg: Config, resume: str | None, started: float) -> Path:
    run_dir, world = job.run_dir, job.world
    main = world.is_main  # rank 0 alone writes the run directory and the console
    error = lock = None
    created = main and not run_dir.exists()
    if main:
        try:
            lock = prepare_run_dir(run_dir, resume, world)
        except UserError as exc:
            error = str(exc)
        except OSError as exc:  # read-only, a file in the way, permissions: one line, every rank stops
            error = f"cannot use the run directory {run_dir}: {exc.strerror or exc}" + (
                f" ({exc.filename})" if exc.filename else "")
    world.agree(error, "the run directory")
    try:
        return _run_locked(job, cfg, resume, started)
    except BaseException:
        # A run refused before it wrote anything (a bad --resume, say) leaves no empty directory behind.
        if created and run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= {".lock", "config.resolved.json"}:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            lock.close()


def _run_locked(job: Job, cfg: Config, resume: str | None, started: float) -> Path:
    run_dir, world = job.run_dir, job.world
    main = world.is_main
    logger = RunLogger(run_dir, cfg.run.log_jsonl and main)
    _resume(job, run_dir, resume, logger)
    start_update = job.counters.update_step
    if main:
        save_json(cfg, run_dir / "config.resolved.json")
        # once, flushed: without a terminal (no bar) the first update's line may be minutes away
        batch, n = cfg.training.batch_size * cfg.training.gradient_accumulation_steps, job.trainer.total_updates
        # dynamic sampling spends more prompts on an update whose groups all score alike: the data ends sooner
        extra = cfg.rollout.dynamic_sampling and cfg.rollout.max_resample_batches > 0
        console(f"[mlx-grpo] train: model {cfg.model.model_name}, {len(job.train_examples)} prompts, "
                f"{'up to ' if extra else ''}{n} update{'s' * (n != 1)} of {batch} "
                f"prompt{'s' * (batch != 1)} x {cfg.rollout.num_generations} completions"
                + (" (dynamic sampling draws more prompts where a group's rewards are all equal)" if extra else "")
                + (f", a time budget of {cfg.run.max_minutes:g} minutes" if cfg.run.max_minutes else "")
                + (f" (resuming after update {start_update})" if resume is not None else "")
                + f"; run directory {run_dir}")
    reporters = Reporters(cfg.run.report_to if main else [], run_dir, to_dict(cfg),
                          resumed_at=start_update if resume is not None else None)
    try:
        records, last_eval = _loop(job, cfg, resume, logger, reporters)
    except BaseException:
        reporters.close(failed=True)
        raise
    reporters.close()
    c = job.counters
    if main:
        checkpoints = ckpt.list_checkpoints(run_dir)
        if resume is not None:  # the summary covers the whole run: its logs hold the sessions before this one
            records, last_eval = _whole_run(run_dir, records, last_eval)
        rewards = [(r["update_step"], r["reward_mean"]) for r in records]
        for line in summary_lines(c.update_step, c.update_step - start_update, time.perf_counter() - started,
                                  rewards, last_eval, checkpoints[-1] if checkpoints else None, records):
            console(line)
        curves = _curves(run_dir)
        if curves:
            console(curves)
    world.print(f"[mlx-grpo] done: {c.update_step} update{'s' * (c.update_step != 1)}; run directory {run_dir}")
    return run_dir


def _whole_run(run_dir: Path, records: list[dict], last_eval: dict | None) -> tuple[list[dict], dict | None]:
    """A resumed run's metrics records and last evaluation from its logs (truncated at the resumed update, so
    every session's updates once), or this session's when log_jsonl is off."""
    from mlx_grpo.reporting.plot import read_jsonl

    evals = read_jsonl(run_dir / "eval.jsonl")
    return read_jsonl(run_dir / "metrics.jsonl") or records, last_eval or (evals[-1] if evals else None)


def _curves(run_dir: Path) -> str | None:
    """Draw RUN_DIR/curves.png when matplotlib is installed, else name the command; never fails the run."""
    from mlx_grpo.reporting.plot import INSTALL_HINT, plot_run

    if not (run_dir / "metrics.jsonl").is_file():  # log_jsonl = false: nothing to draw
        return None
    if importlib.util.find_spec("matplotlib") is None:
        return f"[mlx-grpo]   curves: mlx-grpo plot {run_dir} (needs matplotlib: {INSTALL_HINT})"
    try:
        return f"[mlx-grpo]   curves: {plot_run(run_dir)} (redraw: mlx-grpo plot {run_dir})"
    except Exception as exc:  # the run is done and saved: a plotting problem is only reported
        return f"[mlx-grpo]   could not draw the curves ({type(exc).__name__}: {exc}); try mlx-grpo plot {run_dir}"


PHASES = {"rollout": "sampling rollouts and their log-prob passes (a fresh GPU machine first builds its kernels)",
          "train": "collecting rewards and the training pass", "eval": "evaluating"}


def _phase(bar: tqdm, name: str, i: int = 0, n: int = 1, span: int = 1, announce: str = "") -> None:
    """Show what the update is doing in the progress bar's description (text only: no device sync);
    span > 1: steps i+1 .. i+span at once (batch steps whose rollouts decode together). Without a bar (not a
    terminal) `announce` ("working on update N", the session's first update on rank 0) prints the phase as a
    line: that update can take minutes before its own line, and logs should not be silent meanwhile."""
    if not bar.disable:
        steps = f"{i + 1}-{i + span}" if span > 1 else f"{i + 1}"
        bar.set_description_str(f"grpo [{name}{f' {steps}/{n}' if n > 1 else ''}]")
    elif announce:
        console(f"[mlx-grpo] {announce}: {PHASES[name]}")


def _step_evals(job: Job, bar: tqdm, logger: RunLogger, reporters: Reporters, examples, n: int) -> dict | None:
    """Once an update's n batch steps are sampled, before its update: eval_steps' evaluations (one per batch
    step numbered a multiple of it, as when steps were sampled one by one); -> the last eval record."""
    cfg, step, last = job.cfg, job.counters.batch_step, None
    for k in range(step - n + 1, step + 1):
        if cfg.eval.eval_steps and k % cfg.eval.eval_steps == 0:
            _phase(bar, "eval")
            last = _evaluate(job, logger, reporters, examples, "eval_steps") or last
    return last


def _loop(job: Job, cfg: Config, resume: str | None, logger: RunLogger,
          reporters: Reporters) -> tuple[list[dict], dict | None]:
    """The updates with their logs, evaluations and checkpoints; returns the metrics records of this
    session's updates and the last eval record (rank 0)."""
    world, trainer, source = job.world, job.trainer, job.source
    main = world.is_main
    records, last_eval = [], None
    evals = job.eval_examples
    eval_subset = subset(evals, cfg.eval.eval_subset_size, cfg.run.seed) if evals else None
    legacy_subset = subset(evals, cfg.eval.eval_samples or cfg.eval.eval_subset_size, cfg.run.seed) if evals else None
    c = job.counters
    bar = tqdm(total=trainer.total_updates, initial=c.update_step, desc="grpo", unit="update",
               disable=None if main else True)
    last_saved = c.update_step if resume is not None else -1
    t_last = t_start = time.perf_counter()
    start_update = c.update_step
    accumulation, iterations = cfg.training.gradient_accumulation_steps, cfg.objective.num_iterations
    while c.update_step < trainer.total_updates:
        announce = f"working on update {c.update_step + 1}" if main and c.update_step == start_update else ""
        _phase(bar, "rollout", 0, accumulation, accumulation, announce)  # and their log-prob passes
        steps = source.next()  # sampled, rewards submitted, old/reference log-probs
        if steps is None:
            break
        last_eval = _step_evals(job, bar, logger, reporters, legacy_subset, len(steps.batches)) or last_eval
        stats = [batch.stats for batch in steps.batches]
        save_due = False
        for i in range(iterations):
            _phase(bar, "train", i, iterations, announce=announce if i == 0 else "")  # and rewards still computing
            result = trainer.update(steps)
            result.time_step_s = time.perf_counter() - t_last  # wall time since the last update's end
            merged, result = merge_ranks(world.gather((stats, result), "the metrics"))
            stop = job.health.observe_drawn(c.update_step, [s.drawn_scores for s in merged])  # every rank
            if not stop and cfg.eval.eval_every_updates and c.update_step % cfg.eval.eval_every_updates == 0:
                _phase(bar, "eval")  # before the update's record, which carries what the eval showed
                last_eval = _evaluate(job, logger, reporters, eval_subset, "eval_every_updates") or last_eval
            warnings = job.health.take_warnings()
            if main:
                record = update_record(cfg, c, steps.position, merged, result)
                record["warnings"].update(warnings)
                logger.log_metrics(record)
                reporters.log(record, c.update_step)
                records.append(record)
                logger.warn(record)
                if cfg.run.logging_steps and c.update_step % cfg.run.logging_steps == 0:
                    bar.set_postfix(reward=fmt(record["reward_mean"], ".3f"), loss=fmt(record["loss"], ".4f"),
                                    kl=fmt(record["kl"], ".4f"), refresh=False)
                    # the updates left: the data left at this run's draws per update (dynamic sampling > 1)
                    drawn = trainer.schedule_position(steps.position.batches)
                    elapsed = time.perf_counter() - t_start
                    left = math.ceil((trainer.total_updates - drawn) * c.update_step / max(drawn, 1))
                    timing = (elapsed, c.update_step - start_update, left, 60 * cfg.run.max_minutes, c.update_step,
                              iterations)
                    if bar.disable:  # no bar (not a terminal): the line says how far and how long
                        logger.print_line(record, pace(*timing))
                    else:  # the bar's total (and so its ETA) follows the same count
                        bar.total = c.update_step + updates_left(*timing)[0]
                if cfg.run.log_completions_steps and c.update_step % cfg.run.log_completions_steps == 0:
                    logger.log_completions(c.update_step, merged[-1])
            if stop:  # logged first: metrics.jsonl shows the update that stopped the run
                bar.close()
                world.fail(stop)
            save_due = save_due or bool(cfg.run.save_steps and c.update_step % cfg.run.save_steps == 0)
            bar.update(1)
            t_last = time.perf_counter()
        if save_due:  # only between rollout groups, where resume reproduces the run exactly
            _save(job)
            last_saved = c.update_step
            t_last = time.perf_counter()  # time_step_s leaves the checkpoint out
        if job.health.s.solved:  # every rank (merged figures); after the group, where a checkpoint resumes exactly
            break
        if cfg.run.max_minutes and c.update_step < trainer.total_updates and any(
                world.gather(time.perf_counter() - t_start >= 60 * cfg.run.max_minutes, "the time limit")):
            world.print(f"[mlx-grpo] max_minutes = {cfg.run.max_minutes:g} reached after {c.update_step} of "
                        f"{trainer.total_updates} update{'s' * (trainer.total_updates != 1)}")
            break
    bar.set_description_str("grpo", refresh=False)
    bar.close()
    if job.health.s.solved:
        world.print(f"[mlx-grpo] {job.health.s.solved}")
    if source.exhausted:
        world.print(f"[mlx-grpo] the training data ran out after {c.update_step} of {trainer.total_updates} "
                    f"updates: dynamic sampling drew {c.draws - c.batch_step} extra batches of prompts")
    if last_saved != c.update_step:
        _save(job)
    if c.skipped_updates:
        world.print(f"[mlx-grpo] {c.skipped_updates} update(s) skipped for non-finite values")
    return records, last_eval


def _save(job: Job) -> None:
    """Rank 0 writes the checkpoint: every rank holds the same weights (the same averaged gradients). Every
    rank drops its carried groups (carry_surplus), which a checkpoint does not hold."""
    job.sampling.drop_carried()
    if job.world.is_main:
        with ckpt.write_failures_as_one_line(job.run_dir, job.counters.update_step, job.resumed):
            job.save()
