"""What a teacher costs in memory: the peak memory of a few arith updates (configs/arith.toml's batch, the
process's peak as the metrics line reports it) for GRPO without a reference model, GRPO with its KL
reference (a frozen copy as large as the student), and on-policy distillation (configs/arith_distill.toml)
with a teacher as large as the student, in the compute dtype and quantized to 4 bits. The teacher is the
student's own base model (its weights do not change what it costs). Each case runs in its own process.

usage: python bench/distill_memory.py OUT_DIR [--updates 3] [--set key=value ...] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from mlx_grpo.models.model_loading import resolve_model_path  # noqa: E402


def quantized_copy(model_dir: str, out: Path) -> Path:
    """A 4-bit copy of a model directory (mlx-lm's converter), made once."""
    if not (out / "config.json").is_file():
        from mlx_lm import convert
        convert(model_dir, str(out), quantize=True, q_bits=4, q_group_size=64)
    return out


def run_case(name: str, config: str, sets: list[str], out: Path) -> dict:
    """Train a few updates in a fresh process; -> the last metrics record's peak memory and timings."""
    run_dir = out / "runs"
    # the buffer cache capped as when runs share a GPU (the peak counts live arrays, not the cache)
    cmd = [sys.executable, str(ROOT / "bench" / "with_cache_limit.py"), "5", "train", "--config", str(ROOT / config),
           "--set", f"output_dir={run_dir}", "--set", f"run_name={name}", "--set", "save_steps=0",
           "--set", "eval_every_updates=0"] + [a for s in sets for a in ("--set", s)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=out)
    if done.returncode != 0:
        raise SystemExit(f"{name}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / name / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    updates = [r for r in records if "peak_memory_gb" in r]
    return {"case": name, "peak_memory_gb": updates[-1]["peak_memory_gb"], "updates": len(updates),
            "step_s_median": sorted(r["time_step_s"] for r in updates)[len(updates) // 2]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], help="key=value for every case (e.g. model_name=DIR)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    out = Path(args.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = next((s.split("=", 1)[1] for s in args.set if s.startswith("model_name=")), "smollm2-135m-instruct")
    base = resolve_model_path(model)
    q4 = quantized_copy(base, out / "teacher-4bit")
    common = [f"max_train_samples={16 * args.updates}", "num_epochs=1", "max_minutes=0"] + args.set
    cases = [("grpo", "configs/arith.toml", ["kl_coeff=0"]),
             ("grpo_kl_reference", "configs/arith.toml", []),
             ("distill_teacher_same_size", "configs/arith_distill.toml", [f"teacher_model={base}"]),
             ("distill_teacher_4bit", "configs/arith_distill.toml", [f"teacher_model={q4}"])]
    rows = [run_case(name, config, common + extra, out) for name, config, extra in cases]
    base_peak = rows[0]["peak_memory_gb"]
    for r in rows:
        r["vs_grpo"] = round(r["peak_memory_gb"] / base_peak, 3)
        print(f"{r['case']:28s} peak {r['peak_memory_gb']:.3f} GB  x{r['vs_grpo']:.2f} of GRPO without reference "
              f"({r['updates']} updates)")
    if args.out:
        Path(args.out).write_text(json.dumps({"model": model, "cases": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
