"""`mlx-grpo sft`'s run: the supervised warm start before GRPO. The run directory, resume, the update loop
with its logs (metrics.jsonl, eval.jsonl), evaluations and checkpoints; sft/steps.py owns the steps and
sft/rows.py the rows.

The checkpoints are `train`'s kind (storage/checkpoint.py): a full-weight one is a complete model directory, so
`mlx-grpo train --set model_name=RUN_DIR/checkpoint-N` starts GRPO from exactly its weights (its float32
masters too, assembly.build_model); an adapter one is merged first with `mlx-grpo fuse` (docs/sft.md), as the
summary's last line and sft/steps.start_from's hints say.
"""

from __future__ import annotations

import shlex
import shutil
import time
from pathlib import Path

from tqdm import tqdm

from mlx_grpo.base.console import console
from mlx_grpo.base.errors import UserError
from mlx_grpo.commands.assembly import build_model
from mlx_grpo.commands.evaluate import answer_records, summarize
from mlx_grpo.config import Config, save_json, to_dict
from mlx_grpo.reporting.logs import RunLogger, duration, fmt, pace
from mlx_grpo.reporting.reporters import Reporters, check_installed
from mlx_grpo.rollout.engine import RolloutEngine
from mlx_grpo.rollout.multiturn import multiturn_for
from mlx_grpo.sft.rows import SFTData, load_sft_data
from mlx_grpo.sft.steps import SFTTrainer, check_sft_checkpoint, fused_dir
from mlx_grpo.storage import checkpoint as ckpt
from mlx_grpo.storage.run_dir import check_writable, prepare_run_dir
from mlx_grpo.training.distributed import World


def run_sft(cfg: Config, resume: str | None = None) -> Path:
    """Supervised fine-tuning as configured (or continue its checkpoint); returns the run directory."""
    started = time.perf_counter()
    check_installed(cfg.run.report_to)
    check_writable(Path(cfg.run.output_dir) / cfg.run.run_name)  # before the model and the data load
    built = build_model(cfg, say=lambda line: print(line, flush=True))
    model_type = getattr(getattr(built.model, "args", None), "model_type", None)
    multiturn = multiturn_for(cfg, built.tokenizer, model_type)
    data = load_sft_data(cfg, built.tokenizer, multiturn, say=console)
    run_dir = Path(cfg.run.output_dir) / cfg.run.run_name
    trainer = SFTTrainer(cfg, built.model, built.tokenizer, data.rows, run_dir, built.source_dir, built.masters,
                         built.adapter_config)
    created = not run_dir.exists()
    try:
        lock = prepare_run_dir(run_dir, resume, World())
    except OSError as exc:
        raise UserError(f"cannot use the run directory {run_dir}: {exc.strerror or exc}") from None
    try:
        return _run_locked(trainer, resume, data, multiturn, started)
    except BaseException:
        # a run refused before it wrote anything (a bad --resume, say) leaves no empty directory behind
        if created and run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= {".lock", "config.resolved.json"}:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    finally:
        lock.close()


def _resume(trainer: SFTTrainer, resume: str | None, logger: RunLogger) -> None:
    run_dir = trainer.run_dir
    if resume is None:
        if ckpt.list_checkpoints(run_dir):
            raise UserError(f"run directory {run_dir} already holds checkpoints: pass --resume to continue it, or "
                            "choose another run_name")
        return
    path, loaded = ckpt.read_for_resume(run_dir, resume, console)
    check_sft_checkpoint(path, loaded[2])  # before the settings: a `train` checkpoint's GRPO keys are no "change"
    changed = ckpt.config_changes(path, trainer.cfg)
    if changed:
        raise UserError(f"--resume: {path} was written with other settings that change the run: "
                        f"{', '.join(changed)}; resume with its config: "
                        f"{ckpt.resume_command('sft', path, resume == 'latest')}, or start a new run (another "
                        "run_name). Only logging, eval, saving and timeouts may change")
    trainer.restore(path, loaded)
    trainer.resumed = (path, trainer.counters.update_step)
    logger.truncate_after(trainer.counters.update_step)
    for name in ckpt.set_aside_later(run_dir, trainer.counters.update_step):
        console(f"[mlx-grpo] {name}: a checkpoint after the resumed one, moved aside so that a later --resume "
                "cannot return to the abandoned branch")
    console(f"[mlx-grpo] resumed from {path} at update {trainer.counters.update_step}")


def _evaluate(trainer: SFTTrainer, engine: RolloutEngine, data: SFTData, multiturn, logger: RunLogger,
              reporters: Reporters, trigger: str) -> dict:
    """Greedy exact match of the model now on the eval subset (commands/evaluate.py, with the prompt `train`
    evaluates with), logged."""
    cfg = trainer.cfg
    engine.refresh(trainer.model)  # the weights changed since the engine last sampled
    records = answer_records(trainer.model, trainer.tokenizer, data.evals, cfg,
                             max_new_tokens=cfg.eval.eval_max_new_tokens, progress=True, engine=engine,
                             multiturn=multiturn, system_prompt=data.eval_prompt.system)
    result = summarize(records)
    record = {"update_step": trainer.counters.update_step, "trigger": trigger, "accuracy": result.accuracy,
              "accuracy_lenient": result.lenient_accuracy, "format_rate": result.format_rate,
              "num_examples": len(data.evals), "worked_examples": len(data.eval_prompt.examples)}
    if result.tool_call_rate is not None:
        record["tool_call_rate"] = result.tool_call_rate
    logger.log_eval(record)
    reporters.log_eval(record, record["update_step"])
    return record


def _run_locked(trainer: SFTTrainer, resume: str | None, data: SFTData, multiturn, started: float) -> Path:
    cfg, run_dir, cut, evals = trainer.cfg, trainer.run_dir, data.cut, data.evals
    logger = RunLogger(run_dir, cfg.run.log_jsonl)
    _resume(trainer, resume, logger)
    c = trainer.counters
    save_json(cfg, run_dir / "config.resolved.json")
    start_update = c.update_step
    reporters = Reporters(cfg.run.report_to, run_dir, to_dict(cfg), resumed_at=start_update if resume else None)
    engine = RolloutEngine(trainer.tokenizer, mode=cfg.rollout.rollout_engine) if evals else None
    if cut:
        console(f"[mlx-grpo] {cut} of {len(trainer.rows)} prompts were longer than max_prompt_length = "
                f"{cfg.data.max_prompt_length} tokens and were cut from the left")
    rows, updates = len(trainer.rows), trainer.total_updates
    per = cfg.training.batch_size * cfg.training.gradient_accumulation_steps
    console(f"[mlx-grpo] sft: model {cfg.model.model_name}, {rows} row{'s' * (rows != 1)}, "
            f"{sum(r.trained for r in trainer.rows)} trained tokens, {updates} update{'s' * (updates != 1)} of "
            f"{per} row{'s' * (per != 1)}"
            + (f" (resuming after update {start_update})" if resume else "") + f"; run directory {run_dir}")
    losses, last_eval, last_saved = [], None, c.update_step if resume else -1
    bar = tqdm(total=trainer.total_updates, initial=c.update_step, desc="sft", unit="update", disable=None)
    t_start = t_last = time.perf_counter()
    try:
        while c.update_step < trainer.total_updates and (rows := trainer.next_rows()) is not None:
            record = trainer.update(rows)
            record.update(prompts_cut=cut, time_step_s=time.perf_counter() - t_last)
            logger.log_metrics(record)
            reporters.log(record, c.update_step)
            losses.append(record["loss"])
            bar.set_postfix(loss=fmt(record["loss"], ".4f"), refresh=False)
            bar.update(1)
            if bar.disable and cfg.run.logging_steps and c.update_step % cfg.run.logging_steps == 0:
                console(f"[mlx-grpo] sft update {c.update_step}: loss {fmt(record['loss'], '.4f')} tokens "
                        f"{record['tokens']} lr {record['lr']:.2e}, " + pace(time.perf_counter() - t_start,
                                                                             c.update_step - start_update,
                                                                             trainer.total_updates - c.update_step,
                                                                             60 * cfg.run.max_minutes))
            if evals and c.update_step % cfg.eval.eval_every_updates == 0:
                last_eval = _evaluate(trainer, engine, data, multiturn, logger, reporters, "eval_every_updates")
            if cfg.run.save_steps and c.update_step % cfg.run.save_steps == 0:
                _save(trainer)
                last_saved = c.update_step
            t_last = time.perf_counter()
            if cfg.run.max_minutes and time.perf_counter() - t_start >= 60 * cfg.run.max_minutes \
                    and c.update_step < trainer.total_updates:
                console(f"[mlx-grpo] max_minutes = {cfg.run.max_minutes:g} reached after {c.update_step} of "
                        f"{trainer.total_updates} update{'s' * (trainer.total_updates != 1)}")
                break
        bar.close()
        if evals and (last_eval is None or last_eval["update_step"] != c.update_step):
            last_eval = _evaluate(trainer, engine, data, multiturn, logger, reporters, "end")
        final = _save(trainer) if last_saved != c.update_step else ckpt.resume_point(run_dir, trainer.resumed)
    except BaseException:
        reporters.close(failed=True)
        raise
    reporters.close()
    _summary(trainer, losses, last_eval, final, time.perf_counter() - started)
    return run_dir


def _save(trainer: SFTTrainer) -> Path:
    with ckpt.write_failures_as_one_line(trainer.run_dir, trainer.counters.update_step, trainer.resumed):
        return trainer.save()


def _summary(trainer: SFTTrainer, losses: list[float], last_eval: dict | None, final: Path, wall_s: float) -> None:
    c = trainer.counters
    finite = [x for x in losses if x == x]
    console(f"[mlx-grpo] sft summary: {c.update_step} update{'s' * (c.update_step != 1)}, {c.tokens_seen} trained "
            f"tokens, wall time {duration(wall_s)}"
            + (f"; loss {finite[0]:.4f} -> {finite[-1]:.4f} (this session)" if finite else ""))
    if last_eval is not None:
        console(f"[mlx-grpo]   eval (update {last_eval['update_step']}): accuracy {last_eval['accuracy']:.3f}, "
                f"lenient {last_eval['accuracy_lenient']:.3f}, format {last_eval['format_rate']:.3f} on "
                f"{last_eval['num_examples']} example{'s' * (last_eval['num_examples'] != 1)}")
    console(f"[mlx-grpo]   final checkpoint: {final}")
    # a command that runs as printed (the run's GRPO settings go on it: --config FILE.toml)
    model, fuse = final, ""
    if trainer.adapter_config is not None:  # no run starts from adapters: merged into a model first
        model, merged = fused_dir(final)
        fuse = "" if merged else (f"mlx-grpo fuse --checkpoint {shlex.quote(str(final))} --output-dir "
                                  f"{shlex.quote(str(model))}, then ")
    console(f"[mlx-grpo]   GRPO from it: {fuse}mlx-grpo train --set model_name={shlex.quote(str(model))} "
            "(plus your --config)")
