"""bench/crash_resume.py as CI runs it: a tiny run killed with SIGKILL twice (once inside a checkpoint
write), resumed each time, ends bitwise where the uninterrupted run ends, and no checkpoint is ever
left unreadable."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_sigkill_and_resume_equal_the_uninterrupted_run(tiny_model_dir, tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "crash_resume.py"), "--model", str(tiny_model_dir),
                           "--kills", "2", "--workdir", str(tmp_path), "--seed", "1"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout)
    assert result["killed_while_saving"] == 1 and result["metrics_equal"] and result["state_differs"] == []
    assert result["unreadable_checkpoints_seen"] == []
