"""Checkpoints: write atomically (temporary directory, then rename), find the latest, read back.

A checkpoint directory is a complete MLX model (model.safetensors, config.json, the source model's
tokenizer files) that `mlx-grpo generate --model` opens, in the run's compute dtype, plus what exact resume
needs: optimizer.safetensors (flattened state tree), trainer_state.json, config.resolved.json, with mixed
precision master_weights.safetensors (the float32 masters of the trained tensors) and, when the sampling
policy lags the trained one, old_model.safetensors (update_every > 1; async_rollouts: the weights the
rollout in flight samples from, training/prefetch.py).

An adapter (LoRA/DoRA/QLoRA) checkpoint stores only what training changed: adapters.safetensors and
adapter_config.json (mlx-lm's format, plus the base model it was trained on) instead of
model.safetensors, and old_adapters.safetensors for a lagging sampling policy. config.json is still
the base's, and `mlx-grpo generate --model` opens it through models/adapters.py.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlx_grpo.base.errors import UserError
from mlx_grpo.config import RESUME_MAY_CHANGE, Config, save_json, to_dict
from mlx_grpo.models.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_parameters
from mlx_grpo.models.precision import dtype_name
from mlx_grpo.models.writing import copy_model_files, staged_output

PREFIX = "checkpoint-"
TMP_PREFIX = ".tmp-checkpoint-"
MASTERS = "master_weights.safetensors"


def save_checkpoint(run_dir: Path, update_step: int, *, model, optimizer, trainer_state: dict[str, Any],
                    config: Config, source_dir: Path, model_config: dict[str, Any],
                    old_params: dict | None = None, adapter_config: dict | None = None,
                    masters: dict | None = None) -> Path:
    """Write checkpoint-<update_step>/ atomically and durably (models/writing.staged_output): an
    interrupted save leaves no partial checkpoint, and a checkpoint of the same step is replaced only
    once the new one is on disk.
    With adapter_config (apply_adapters' dict, plus the "mlx_grpo" base record) only the adapter
    tensors are written, of the model and of old_params (nested or flat; other tensors are dropped)."""
    final = run_dir / f"{PREFIX}{update_step}"
    with staged_output(final, replace=True, prefix=TMP_PREFIX) as tmp:
        if adapter_config is None:
            mx.save_safetensors(str(tmp / "model.safetensors"), dict(tree_flatten(model.parameters())),
                                metadata={"format": "mlx"})
        else:
            adapters = adapter_parameters(model)
            mx.save_safetensors(str(tmp / ADAPTER_WEIGHTS), adapters, metadata={"format": "mlx"})
            (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2) + "\n")
        mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(optimizer.state)))
        if masters is not None:  # flat, float32
            mx.save_safetensors(str(tmp / MASTERS), masters)
        if old_params is not None and adapter_config is None:
            mx.save_safetensors(str(tmp / "old_model.safetensors"), dict(tree_flatten(old_params)))
        elif old_params is not None:
            old = {k: v for k, v in tree_flatten(old_params) if k in adapters}
            mx.save_safetensors(str(tmp / "old_adapters.safetensors"), old)
        (tmp / "config.json").write_text(json.dumps(model_config, indent=2) + "\n")
        # A source that is itself an adapter checkpoint must not lend this one its adapter config.
        copy_model_files(source_dir, tmp, skip={ADAPTER_CONFIG})
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2) + "\n")
        save_json(config, tmp / "config.resolved.json")
    return final


@contextmanager
def write_failures_as_one_line(run_dir: Path, update_step: int, resumed: tuple[Path, int] | None = None):
    """Around a checkpoint save (train and sft): a full disk or a lost mount (OSError, or MLX's writer's
    RuntimeError "[write] ...") ends the run with one line naming the checkpoint to resume from. The staged copy
    is gone (staged_output), the earlier checkpoints are intact. Other RuntimeErrors (a GPU fault or out of
    memory while the arrays are evaluated for the write) go on to the crash and memory handlers. resumed:
    (checkpoint, update) the run restored."""
    try:
        yield
    except (OSError, RuntimeError) as exc:
        text = (getattr(exc, "strerror", None) or str(exc)).strip()
        reason = text.splitlines()[0] if text else type(exc).__name__
        if isinstance(exc, RuntimeError) and not re.match(r"\[(write|save\w*)\] ", reason):
            raise
        if isinstance(exc, OSError):
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            when = "once there is room" if full else "once the disk can be written again"
        else:  # MLX's writer says neither which errno nor whether the disk is full
            when = "once there is room (or the disk can be written again)"
        try:
            intact = resume_point(run_dir, resumed)
        except OSError:  # the mount is gone: the directory cannot even be listed
            intact = resumed[0] if resumed else None
            if intact is None:
                raise UserError(f"saving checkpoint-{update_step} in {run_dir} failed: {reason}; the run directory "
                                f"cannot be read now: {when}, the command with --resume latest continues from its "
                                "newest checkpoint") from None
        if intact is None:
            then = f"no checkpoint of this run exists yet: {when}, a rerun starts over"
        else:
            # named, as the crash line names it: a plain --resume of a command that resumed elsewhere goes back there
            then = f"{intact} is intact: {when}, the command with --resume {intact} continues from it"
        raise UserError(f"saving checkpoint-{update_step} in {run_dir} failed: {reason}; {then}") from None


def resume_point(run_dir: Path, resumed: tuple[Path, int] | None) -> Path | None:
    """The newest checkpoint of this run: the run directory's newest if this session wrote it (a resume sets
    aside later ones, so a later update means ours; the failed save's own checkpoint when only what followed
    its rename failed), else the one resumed from (perhaps in another directory); None for neither. OSError
    where the run directory exists but cannot be listed (a lost mount, no permission)."""
    try:  # Path.glob (list_checkpoints) reads such a directory as empty on Python 3.12+: "no checkpoint" would be wrong
        os.listdir(run_dir)
    except (FileNotFoundError, NotADirectoryError):  # not made yet: it holds none
        pass
    written = list_checkpoints(run_dir)
    newest = written[-1] if written else None
    if resumed is None:
        return newest
    if newest is not None and int(newest.name[len(PREFIX):]) > resumed[1]:
        return newest
    return resumed[0]


def resume_point_after_crash(run_dir: Path, resume: str | None) -> Path | None:
    """resume_point for a command given `--resume resume` (None, 'latest' or a checkpoint directory), read from
    disk when the trainer is gone: an explicit checkpoint's update is its trainer_state's counters. One that
    cannot be read (the crash came while checking it) counts as not resumed. A crash while the resume still
    loads, before later checkpoints are set aside, gets the run directory's newest (resume_point's rule). A
    run directory that cannot be listed (a lost mount) gives the resumed checkpoint, as a failed save's line
    does, and raises OSError when there is none."""
    resumed = None
    if resume not in (None, "latest"):
        try:
            state = json.loads((Path(resume) / "trainer_state.json").read_text())
            resumed = (Path(resume), int(state["counters"]["update_step"]))
        except (OSError, ValueError, KeyError, TypeError):
            resumed = None
    try:
        return resume_point(run_dir, resumed)
    except OSError:
        if resumed is None:
            raise
        return resumed[0]


def prune(run_dir: Path, keep: int, protect: Path) -> list[Path]:
    """save_total_limit: delete all but the newest `keep` checkpoints (never `protect`, the one just
    written); keep 0 keeps all. -> the deleted ones."""
    if keep <= 0:
        return []
    gone = [p for p in list_checkpoints(run_dir)[:-keep] if p != protect]
    for path in gone:
        # renamed first: a kill mid-delete leaves a temporary the next start removes, not a half checkpoint
        doomed = path.with_name(f"{TMP_PREFIX}pruned-{path.name}")
        path.rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return gone


def list_checkpoints(run_dir: Path) -> list[Path]:
    found = []
    for path in run_dir.glob(f"{PREFIX}*"):
        suffix = path.name[len(PREFIX):]
        if path.is_dir() and suffix.isdecimal() and (path / "trainer_state.json").is_file():
            found.append((int(suffix), path))
    return [p for _, p in sorted(found)]


def _no_checkpoint(run_dir: Path) -> str:
    """--resume's line for a run directory that holds no checkpoint, saying why: a run that started there
    (it wrote config.resolved.json first) stopped before its first save, or none ever ran there."""
    stored = run_dir / "config.resolved.json"
    if not stored.is_file():
        return (f"--resume: no checkpoint found in {run_dir}: no run has started there (check output_dir and "
                "run_name); without --resume a run starts there")
    try:
        save_steps = json.loads(stored.read_text()).get("save_steps")
    except (OSError, ValueError, AttributeError):  # unreadable, or not the flat form: the line goes without
        save_steps = None
    if save_steps == 0:
        why = "save_steps = 0 writes a checkpoint only at the end"
    elif isinstance(save_steps, int):
        why = f"save_steps = {save_steps} writes the first one after update {save_steps}"
    else:
        why = "it wrote none"
    return (f"--resume: no checkpoint found in {run_dir}: the run there stopped before its first checkpoint "
            f"({why}); without --resume a rerun starts over")


def read_for_resume(run_dir: Path, resume: str, say=print) -> tuple[Path, tuple]:
    """The checkpoint to resume and what it holds: (path, (weights, optimizer state, trainer state, old
    policy, masters)). 'latest' takes the newest readable checkpoint of run_dir, saying which it skipped
    and why; an explicit directory that cannot be read is a one-line error."""
    def read(path: Path) -> tuple[Path, tuple]:
        return path, (*load_checkpoint(path), load_masters(path))

    if resume != "latest":
        path = Path(resume)
        if not (path / "trainer_state.json").is_file():
            raise UserError(f"--resume: {path} is not a checkpoint directory (no trainer_state.json)")
        try:
            return read(path)
        except Exception as exc:  # a truncated or corrupted file: name it, no traceback
            raise UserError(f"--resume: {path} cannot be read ({type(exc).__name__}: {exc})") from None
    checkpoints = list_checkpoints(run_dir)
    if not checkpoints:
        raise UserError(_no_checkpoint(run_dir))
    for path in reversed(checkpoints):
        try:
            return read(path)
        except Exception as exc:
            say(f"[mlx-grpo] --resume: skipping {path.name}, which cannot be read ({type(exc).__name__}: {exc})")
    raise UserError(f"--resume: none of the {len(checkpoints)} checkpoints in {run_dir} can be read")




def resume_command(command: str, path: Path, latest: bool = False) -> str:
    """The command line that resumes the checkpoint at path with the settings it was written with (`--config`
    reads its config.resolved.json as it reads TOML): what a refused resume tells the user to run. latest: path
    is the run directory's newest, which a bare --resume (as the refused command gave) takes."""
    return f"mlx-grpo {command} --config {path / 'config.resolved.json'} --resume" + ("" if latest else f" {path}")


def config_changes(path: Path, config: Config) -> list[str]:
    """The fields whose value differs from the config the checkpoint at path was written with, among
    those that change the run (not declared resume_may_change: config.RESUME_MAY_CHANGE)."""
    saved_file = path / "config.resolved.json"
    if not saved_file.is_file():
        return []
    saved = json.loads(saved_file.read_text())
    now = to_dict(config)
    return [f"{k} ({saved[k]!r} -> {now[k]!r})" for k in sorted(now)
            if k in saved and k not in RESUME_MAY_CHANGE and saved[k] != now[k]]


def set_aside_later(run_dir: Path, step: int) -> list[str]:
    """Resuming checkpoint-<step> abandons the checkpoints after it: rename them abandoned-checkpoint-N
    (not picked by a later --resume) and return their new names."""
    moved = []
    for path in list_checkpoints(run_dir):
        if int(path.name[len(PREFIX):]) > step:
            target = run_dir / f"abandoned-{path.name}"
            n = 1
            while target.exists():
                n += 1
                target = run_dir / f"abandoned-{path.name}.{n}"
            path.rename(target)
            moved.append(target.name)
    return moved


def holds_adapters(path: Path) -> bool:
    """An adapter (LoRA/DoRA/QLoRA) checkpoint: adapters.safetensors instead of model.safetensors."""
    return (path / ADAPTER_WEIGHTS).is_file() and not (path / "model.safetensors").is_file()


def load_checkpoint(path: Path) -> tuple[dict, dict, dict, dict | None]:
    """-> (model weights, optimizer state tree, trainer state, old-policy weights or None).
    For an adapter checkpoint the weights (flat) and the old-policy tree are the adapter tensors only."""
    adapters = holds_adapters(path)
    weights = mx.load(str(path / (ADAPTER_WEIGHTS if adapters else "model.safetensors")))
    optimizer_state = tree_unflatten(list(mx.load(str(path / "optimizer.safetensors")).items()))
    state = json.loads((path / "trainer_state.json").read_text())
    old_file = path / ("old_adapters.safetensors" if adapters else "old_model.safetensors")
    old = tree_unflatten(list(mx.load(str(old_file)).items())) if old_file.is_file() else None
    return weights, optimizer_state, state, old


def load_masters(path: Path) -> dict | None:
    """The float32 master weights (flat) of a mixed-precision checkpoint, or None."""
    return mx.load(str(path / MASTERS)) if (path / MASTERS).is_file() else None


def check_resume(path: Path, loaded: tuple, adapters: bool, *, model, total_updates: int, world_size: int,
                 adapter_run: bool, masters_active: bool) -> None:
    """Refuse, in one line saying what to do, a checkpoint (load_checkpoint's tuple `loaded`, `adapters`
    holds_adapters' answer) that this run cannot continue exactly: another run's length, world size,
    train_type or adapter shapes, compute dtype or master weights."""
    weights, _, state, _, masters = loaded
    if state.get("total_updates", total_updates) != total_updates:
        raise UserError(f"--resume: {path} belongs to a run of {state['total_updates']} "
                        f"update{'s' * (state['total_updates'] != 1)} and this config "
                        f"gives {total_updates}: the data, epochs or batch shape differ; resume with the "
                        f"run's own config: {resume_command('train', path)}")
    saved = state.get("world_size", 1)
    if saved != world_size:
        # Each rank's share of a batch, hence the float sums of the loss and of the gradients, depend
        # on the world size: another one would not continue the run exactly.
        raise UserError(f"--resume: {path} was written by a run of {saved} process(es) and this one has "
                        f"{world_size}; resume with {saved} (e.g. `mlx.launch -n {saved} -- mlx-grpo "
                        "train ... --resume latest`), or start a new run")
    if adapter_run:
        expected = set(adapter_parameters(model))
        if set(weights) != expected:
            raise UserError(f"--resume: the adapters in {path} do not match this config's train_type/lora_* "
                            f"settings ({len(weights)} tensors saved, {len(expected)} expected); resume with the "
                            f"run's own config: {resume_command('train', path)}")
    elif adapters:
        raise UserError(f"--resume: {path} holds lora/dora adapters but train_type is full; resume with the "
                        f"run's own config: {resume_command('train', path)}")
    current = {k: v.dtype for k, v in tree_flatten(model.trainable_parameters())}
    saved = sorted({dtype_name(v.dtype) for k, v in weights.items() if k in current and v.dtype != current[k]})
    if saved:  # loading would silently train in the checkpoint's dtype (or round it to this one's)
        raise UserError(f"--resume: {path} holds {'/'.join(saved)} weights and this run computes in "
                        f"{dtype_name(next(iter(current.values())))}: set model_dtype = {saved[0]} to resume "
                        "it (model_dtype = auto resolves per machine)")
    if masters is not None and not masters_active:
        raise UserError(f"--resume: {path} holds float32 master weights but this run keeps none "
                        "(master_weights = false or float32 compute): resume with the run's own config: "
                        f"{resume_command('train', path)}")


def load_weights(model, weights: dict, path: Path, strict: bool, model_name: str) -> None:
    """Load a checkpoint's weights into `model`; another model's checkpoint is one line, not mlx's list of
    every tensor."""
    try:
        model.load_weights(list(weights.items()), strict=strict)
    except ValueError as exc:
        first = str(exc).splitlines()[0][:200]
        raise UserError(f"--resume: {path} does not fit model {model_name!r} ({first}); resume with "
                        "the model the run was trained from") from None
