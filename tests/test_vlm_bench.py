"""bench/vlm_bench.py (docs/vision.md's speed command) runs on the tiny shape: one JSON line per update, with
one image encoding per prompt."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_vlm")
ROOT = Path(__file__).resolve().parent.parent


def test_vlm_bench_runs_on_the_tiny_shape():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "vlm_bench.py"), "--shape", "tiny", "--updates", "2",
                           "--batch-size", "2", "--generations", "2", "--max-new-tokens", "3", "--dtype", "float32"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["update"] for r in rows] == [1, 2]
    assert all(r["encodings"] == 2 and r["rollout_tokens_per_s"] > 0 and r["step_s"] > 0 for r in rows)
