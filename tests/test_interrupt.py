"""Ctrl-C in every phase of a CLI run (rollout, log-prob pass, training pass, evaluation, saving, and the eval
command): the process ends with exit 130 and one line, although the phase's work never returns (it stands
for a long native call such as MLX evaluating a training pass), and the latest checkpoint still loads."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mlx_grpo.base.interrupt import exit_on_interrupt
from mlx_grpo.models.writing import recover_staged
from mlx_grpo.storage import checkpoint as ckpt

from conftest import sigint_default

ROOT = Path(__file__).resolve().parents[1]

# Runs the CLI with one phase's function replaced, from its `nth` call on, by one that sends this process
# SIGINT and then never returns; earlier calls do the real work (so checkpoint-1 exists before the signal).
DRIVER = """
import importlib, os, signal, sys, time
target, nth, stamp = sys.argv[1], int(sys.argv[2]), sys.argv[3]
module_name, owner_name, attr = target.split(":")
owner = importlib.import_module(module_name)
if owner_name:
    owner = getattr(owner, owner_name)
real, calls = getattr(owner, attr), []
def phase(*args, **kwargs):
    calls.append(1)
    if len(calls) < nth:
        return real(*args, **kwargs)
    with open(stamp, "w") as f:
        f.write(repr(time.time()))
    signalled = False
    while True:  # the work never returns to Python (a long native call): a KeyboardInterrupt cannot end it
        try:
            if not signalled:
                signalled = True
                os.kill(os.getpid(), signal.SIGINT)
            time.sleep(60)
        except KeyboardInterrupt:
            pass
setattr(owner, attr, phase)
from mlx_grpo.commands.cli import main
sys.exit(main(sys.argv[4:]))
"""


def interrupt(tmp_path: Path, target: str, nth: int, argv: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    """Run the CLI (argv) with `target` (module:class:attribute) stalling at its nth call after sending SIGINT;
    -> the finished process and the seconds from the signal to the process's end."""
    stamp = tmp_path / "signalled"
    env = {**os.environ, "TQDM_DISABLE": "1",
           "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-c", DRIVER, target, str(nth), str(stamp), *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120,  # a hang guard only
                          preexec_fn=sigint_default)
    return done, time.time() - float(stamp.read_text()) if stamp.exists() else float("nan")


def train_argv(model: Path, out: Path, *items: str) -> list[str]:
    argv = ["train"]
    for item in (f"model_name={model}", f"output_dir={out}", "run_name=run", "batch_size=2", "num_generations=2",
                 "max_new_tokens=4", "max_train_samples=8", "system_prompt=", "save_steps=1",
                 "eval_subset_size=2", "eval_max_new_tokens=4", *items):
        argv += ["--set", item]
    return argv


def assert_interrupted(done: subprocess.CompletedProcess, command: str, survives: str | None = None) -> None:
    """Exit 130 and one last line: `mlx-grpo COMMAND: interrupted`, then for train/sft what survives (`survives`)."""
    assert done.returncode == 130, done.stderr[-3000:]
    line = f"mlx-grpo {command}: interrupted" + ("" if survives is None else f"; {survives}.")
    assert done.stderr.splitlines()[-1] == line, done.stderr[-3000:]
    assert "Traceback" not in done.stderr


PHASES = {  # phase: (the function that does its work, the call that stalls, extra config)
    "rollout": ("mlx_grpo.training.sampling:TextPrompts:generate", 2, ()),
    # the third pass: the second rollout group's old-policy pass (the first ran its old and reference passes,
    # then saved)
    "log-prob pass": ("mlx_grpo.training.policy::logprob_pass", 3, ("num_iterations=2",)),
    "training pass": ("mlx_grpo.training.trainer::accumulate_gradients", 2, ()),
    "evaluation": ("mlx_grpo.commands.assembly::answer_records", 2, ("eval_every_updates=1",)),
    "saving": ("mlx_grpo.models.writing::make_durable", 2, ()),
}


@pytest.mark.parametrize("phase", list(PHASES))
def test_ctrl_c_ends_a_training_run_in_every_phase(phase, tiny_model_dir, tmp_path):
    target, nth, items = PHASES[phase]
    done, _ = interrupt(tmp_path, target, nth, train_argv(tiny_model_dir, tmp_path, *items))
    run_dir = tmp_path / "run"
    checkpoints = ckpt.list_checkpoints(run_dir)
    assert checkpoints, "the run wrote its first checkpoint before the signal"
    # the line names the newest whole checkpoint (not the one whose write was cut) and how to continue
    assert_interrupted(done, "train", f"{checkpoints[-1]} is intact: the command with --resume {checkpoints[-1]} "
                                      "continues from it")
    path, _ = ckpt.read_for_resume(run_dir, "latest", say=pytest.fail)  # the latest loads, none skipped
    assert path == checkpoints[-1]
    staged = sorted(p.name for p in run_dir.glob(f"{ckpt.TMP_PREFIX}*"))
    if phase == "saving":  # the write that was cut: a temporary that the next start removes
        assert len(staged) == 1 and path.name == "checkpoint-1"
        assert recover_staged(run_dir, ckpt.TMP_PREFIX) == [f"removed the unfinished {staged[0]}"]
    else:
        assert staged == []
    with open(run_dir / ".lock", "a+") as lock:  # the OS released the run's lock: a --resume may start
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_ctrl_c_before_the_first_checkpoint_says_a_rerun_starts_over(tiny_model_dir, tmp_path, capsys):
    """save_steps = 0 writes a checkpoint only at the end: Ctrl-C before it says that nothing was saved, and a
    --resume afterwards says why it finds no checkpoint."""
    from mlx_grpo.commands.cli import main

    argv = train_argv(tiny_model_dir, tmp_path, "save_steps=0")
    done, _ = interrupt(tmp_path, "mlx_grpo.training.sampling:TextPrompts:generate", 2, argv)
    assert_interrupted(done, "train", "no checkpoint of this run was written (save_steps = 0: only at the end): a "
                                      "rerun starts over")
    assert ckpt.list_checkpoints(tmp_path / "run") == []
    assert main(argv + ["--resume"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"mlx-grpo train: error: --resume: no checkpoint found in {tmp_path / 'run'}: the run there stopped before "
        "its first checkpoint (save_steps = 0 writes a checkpoint only at the end); without --resume a rerun starts "
        "over"]


def test_ctrl_c_ends_the_eval_command(tiny_model_dir, tmp_path):
    done, _ = interrupt(tmp_path, "mlx_grpo.commands.evaluate::answer_records", 1,
                        ["eval", "--model", str(tiny_model_dir), "--samples", "2", "--output",
                         str(tmp_path / "eval.jsonl")])
    assert_interrupted(done, "eval")
    assert not (tmp_path / "eval.jsonl").exists()


def test_a_background_job_keeps_ignoring_ctrl_c():
    """Started with SIGINT ignored (`cmd &` in a script, nohup): no watcher, the handler stays SIG_IGN, and a
    SIGINT goes by without ending anything."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with exit_on_interrupt("mlx-grpo train: interrupted"):
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert not any(t.name == "mlx-grpo-ctrl-c" for t in threading.enumerate())
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
