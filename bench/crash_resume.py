"""Fault injection: kill a training run with SIGKILL at N random moments, resume it each time, and check that
it ends exactly where an uninterrupted run ends.

Every third kill (the 1st, 4th, ...) strikes while a checkpoint is being written; the others strike a random
0-50 ms after the run logs a chosen update, spread over the updates still to do, so every kill interrupts
training. The run trains with save_steps = 1 on a few prompts (see base_items; --set overrides).

Checks, printed as one JSON record (exit 1 if any fails):
- final weights, master weights and optimizer state equal the uninterrupted run's, bitwise;
- metrics.jsonl equals the uninterrupted run's, field for field (timings aside);
- after every kill, every checkpoint in the run directory is readable (none left half written).

examples:
  python bench/crash_resume.py --tiny --kills 20            # a tiny random model, built in WORKDIR/tiny-model
  python bench/crash_resume.py --model MODEL_DIR --kills 5 --set max_new_tokens=32
Needs only the base install (no test extras).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from mlx_grpo.models.tiny import write_tiny_model  # noqa: E402
from mlx_grpo.storage import checkpoint as ckpt  # noqa: E402

TIMING = ("time_", "_per_s", "peak_memory")
STATE_FILES = ("model.safetensors", "adapters.safetensors", "master_weights.safetensors", "optimizer.safetensors")


def base_items(model: str, workdir: Path) -> list[str]:
    return [f"model_name={model}", f"output_dir={workdir}", "batch_size=2", "num_generations=4",
            "max_new_tokens=8", "max_train_samples=16", "learning_rate=1e-3", "warmup_ratio=0",
            "max_prompt_length=96", "system_prompt=", "save_steps=1", "log_completions_steps=1",
            # a random model earns no reward: train on (the bench measures kills and resumes, not learning)
            "max_updates_without_signal=0"]


def command(items: list[str], resume: bool) -> list[str]:
    cmd = [sys.executable, "-m", "mlx_grpo", "train"]
    for item in items:
        cmd += ["--set", item]
    return cmd + (["--resume"] if resume else [])


def environment() -> dict:
    return {**os.environ, "TQDM_DISABLE": "1", "PYTHONPATH": str(ROOT / "src") + os.pathsep +
            os.environ.get("PYTHONPATH", "")}


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in rows]


def unreadable(run_dir: Path) -> list[str]:
    """Checkpoints of run_dir that cannot be loaded (a half-written one would show here)."""
    bad = []
    for path in ckpt.list_checkpoints(run_dir):
        try:
            ckpt.load_checkpoint(path)
            ckpt.load_masters(path)
        except Exception as exc:  # report every kind of damage, keep checking the others
            bad.append(f"{path.name}: {type(exc).__name__}: {exc}")
    return bad


def same_state(a: Path, b: Path) -> list[str]:
    """Files of checkpoint a whose tensors differ from checkpoint b's (bitwise)."""
    differ = []
    for name in STATE_FILES:
        if not (a / name).is_file() and not (b / name).is_file():
            continue
        if not ((a / name).is_file() and (b / name).is_file()):
            differ.append(f"{name}: in one run only")
            continue
        x, y = mx.load(str(a / name)), mx.load(str(b / name))
        if x.keys() != y.keys() or not all(mx.array_equal(x[k], y[k]).item() for k in x):
            differ.append(name)
    return differ


def updates_logged(run_dir: Path) -> int:
    # a fresh start moves the logs of a run killed before its first checkpoint aside: the file can
    # vanish between a check and the read, so only the read decides
    try:
        return (run_dir / "metrics.jsonl").read_text().count("\n")
    except FileNotFoundError:
        return 0


def kill_once(cmd: list[str], run_dir: Path, rng: random.Random, total: int, kills_left: int, in_save: bool) -> str:
    """Start the run and SIGKILL it: at the first checkpoint write (in_save), or once it has logged an
    update past its checkpoint (spread so that the remaining kills fit before the run ends), then a
    random 0-50 ms later, so kills land in rollouts, passes, updates and logging alike. -> how it ended."""
    checkpoints = ckpt.list_checkpoints(run_dir) if run_dir.exists() else []
    done = int(checkpoints[-1].name[len(ckpt.PREFIX):]) if checkpoints else 0
    target = done + max(1, (total - done) // (kills_left + 1))
    # a temporary left by the previous kill is not a write of this run (which cleans it up at start)
    stale = {p.name for p in run_dir.glob(f"{ckpt.TMP_PREFIX}*")} if run_dir.exists() else set()
    proc = subprocess.Popen(cmd, env=environment(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while proc.poll() is None:
        # a checkpoint write of a tiny model lasts a few ms: poll often
        saving = in_save and any(p.name not in stale for p in run_dir.glob(f"{ckpt.TMP_PREFIX}*"))
        reached = not in_save and updates_logged(run_dir) >= target
        if saving or reached:
            if reached:
                time.sleep(rng.uniform(0.0, 0.05))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return "killed while saving" if saving else f"killed after update {target}"
        time.sleep(0.0005)
    if proc.returncode != 0:
        raise SystemExit(f"the run failed on its own (exit {proc.returncode}): {proc.stderr.read()[-2000:]}")
    return "finished before the kill"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", metavar="MODEL_DIR",
                       help="the model to train: an MLX model directory or a hub name (a small one keeps it fast)")
    model.add_argument("--tiny", action="store_true",
                       help="train a tiny random-weight llama (2 layers, width 32, byte tokenizer) written to "
                            "WORKDIR/tiny-model: seconds per run, the weights do not matter for the checks")
    parser.add_argument("--kills", type=int, default=20, help="how many times to kill and resume (default: 20)")
    parser.add_argument("--workdir", default="crash-resume",
                        help="directory for the two runs (uninterrupted/, killed/) (default: crash-resume)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments (default: 0)")
    parser.add_argument("--set", dest="items", action="append", default=[], metavar="KEY=VALUE",
                        help="extra config key=value for both runs; repeatable")
    args = parser.parse_args()
    workdir = Path(args.workdir).resolve()
    model_name = str(write_tiny_model(workdir / "tiny-model")) if args.tiny else args.model
    items = base_items(model_name, workdir) + args.items
    rng = random.Random(args.seed)

    t0 = time.monotonic()
    subprocess.run(command(items + ["run_name=uninterrupted"], False), env=environment(), check=True,
                   stdout=subprocess.DEVNULL)
    clean_s = time.monotonic() - t0
    reference = workdir / "uninterrupted"

    run_dir = workdir / "killed"
    cmd = items + ["run_name=killed"]
    events, damaged = [], []
    total = updates_logged(reference)
    for i in range(args.kills):
        resume = bool(ckpt.list_checkpoints(run_dir)) if run_dir.exists() else False
        # every third kill (the 1st, 4th, ...) waits for a checkpoint write and strikes inside it
        events.append(kill_once(command(cmd, resume), run_dir, rng, total, args.kills - i, in_save=i % 3 == 0))
        damaged += unreadable(run_dir) if run_dir.exists() else []
    subprocess.run(command(cmd, bool(ckpt.list_checkpoints(run_dir))), env=environment(), check=True,
                   stdout=subprocess.DEVNULL)

    last_ref, last_run = ckpt.list_checkpoints(reference)[-1], ckpt.list_checkpoints(run_dir)[-1]
    result = {
        "kills": args.kills, "uninterrupted_s": round(clean_s, 1),
        "killed_while_saving": sum(e == "killed while saving" for e in events),
        "finished_before_kill": sum(e == "finished before the kill" for e in events),
        "events": events, "final_checkpoint": [last_ref.name, last_run.name],
        "state_differs": same_state(last_ref, last_run) if last_ref.name == last_run.name else ["final step"],
        "metrics_equal": metrics(reference) == metrics(run_dir),
        "unreadable_checkpoints_seen": damaged,
    }
    print(json.dumps(result, indent=2))
    ok = not result["state_differs"] and result["metrics_equal"] and not damaged
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
