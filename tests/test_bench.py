"""The benchmark harness runs end to end on a tiny model (CI proves it works; figures come from the GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import write_tiny_model

ROOT = Path(__file__).resolve().parent.parent


def test_grpo_bench_runs_every_section_on_a_tiny_model(tmp_path):
    model = write_tiny_model(tmp_path / "model")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"}) + "\n"
                            for i in range(4)))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "grpo_bench.py"), "--model", str(model),
                           "--dtype", "float32", "--data", str(data), "--batch", "2", "--group", "2",
                           "--max-new-tokens", "6", "--sizes", "2x2", "--memory-shape", "4x6", "--memory-budgets", "0,16", "--repeats", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(next(out.glob("grpo_bench-*.json")).read_text())
    assert set(record) >= {"rollout", "logprob", "train", "memory", "step", "device", "versions", "date"}
    rollout = record["rollout"][0]
    assert rollout["ours_noeos_tokens"] == 2 * 2 * 6  # no EOS: every row decodes max_new_tokens
    assert rollout["ratio_ours_vs_plain"] > 0 and record["train"]["ratio_vs_plain"] > 0
    assert [m["micro_batch_tokens"] for m in record["memory"]] == [0, 16]
    assert record["step"]["tokens"] > 0 and len(record["step"]["steps"]) == 2
    assert "vs plain decode loop" in proc.stdout and proc.stdout.rstrip().splitlines()[-1].startswith("JSON:")
