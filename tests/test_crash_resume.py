"""bench/crash_resume.py as CI runs it: a tiny run killed with SIGKILL twice (once inside a checkpoint
write), resumed each time, ends bitwise where the uninterrupted run ends, and no checkpoint is ever
left unreadable."""

import json
import subprocess
import sys
from pathlib import Path

from conftest import ctrl_c_while_scoring_hangs

ROOT = Path(__file__).resolve().parents[1]


# Runs the bench as `python bench/crash_resume.py ARGS` would, with pytest made unimportable: it needs only
# the base install (its --tiny model comes from mlx_grpo.models.tiny).
WITHOUT_PYTEST = ("import runpy, sys; sys.modules['pytest'] = None; sys.argv = sys.argv[1:]; "
                  "runpy.run_path(sys.argv[0], run_name='__main__')")


def test_sigkill_and_resume_equal_the_uninterrupted_run(tmp_path):
    done = subprocess.run([sys.executable, "-c", WITHOUT_PYTEST, str(ROOT / "bench" / "crash_resume.py"), "--tiny",
                           "--kills", "2", "--workdir", str(tmp_path), "--seed", "1",
                           "--set", "max_train_samples=32"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout)
    assert result["killed_while_saving"] == 1 and result["metrics_equal"] and result["state_differs"] == []
    assert result["unreadable_checkpoints_seen"] == []
    assert (tmp_path / "tiny-model" / "model.safetensors").is_file()


def test_help_is_whole():
    shown = subprocess.run([sys.executable, str(ROOT / "bench" / "crash_resume.py"), "--help"],
                           capture_output=True, text=True, timeout=60).stdout
    assert "while a checkpoint is being written" in shown and "Needs only the base install" in shown
    for flag in ("--model MODEL_DIR", "--tiny", "--kills", "--workdir", "--seed", "--set"):
        assert flag in shown
    assert "the model to train" in shown


def test_ctrl_c_stops_a_run_whose_reward_hangs(tiny_model_dir, tmp_path):
    """A scorer that never returns, in a reward worker: Ctrl-C ends the run at once (exit 130) instead of
    waiting for the worker thread at exit."""
    code, err = ctrl_c_while_scoring_hangs(tiny_model_dir, tmp_path, "reward_workers=1",
                                           "gradient_accumulation_steps=2")
    assert code == 130 and "interrupted" in err and "Traceback" not in err
