#!/bin/bash
# The rollout engine's figures for BENCHMARKS.md, on the GPU machine, in parts that each finish well under
# its 10-minute command limit. Run from the repository root; MLX comes from PYTHONPATH (/tmp/mlxsite), the
# GSM8K train split from .gpudata/train.jsonl. Every command's log and JSON record go under OUT.
#
#   bash bench/engine_run.sh decode [OUT]     # ~3-4 min
#   bash bench/engine_run.sh step [OUT]       # ~4-5 min
#   bash bench/engine_run.sh qwen-0.5b [OUT]  # ~3 min
#   bash bench/engine_run.sh qwen-1.5b [OUT]  # ~5 min
#   bash bench/engine_run.sh prod [OUT]       # the prod preset's update time: ~3 min
#   bash bench/engine_run.sh trl [OUT]        # TRL's GRPOTrainer, same workload: ~2 min (needs trl)
#   bash bench/engine_run.sh qwen [OUT]       # both Qwen parts in one go: ~8 min, too close to the limit
#                                             # for one device command; run the two parts apart there
# OUT defaults to $OUT (the device machine's output folder). Environment: PYTHON (default python3), DATA
# (default .gpudata/train.jsonl), MLX_GRPO_CACHE (default /tmp/mgcache: where the embedded SmolLM2 is
# converted on first use, a few seconds).
#
# Estimates are from docs/benchmarks-history.md's H100 figures (2026-11-22), plus ~20-30 s per process for start-up,
# model load and the first call's kernel compiles; times.txt records each command's real duration.
#   decode: decode_profile, 2 step builders x 64/256/1024 rows x ~73 steps (8 warm-up + 32 pipelined + 32
#           serial + 1 graph): the old loop ran 1,024 rows at ~18 ms/step, so < 2 s per row count plus its
#           first-shape compiles: ~1.5 min. grpo_bench rollout 16x16 (256 rows x 256 tokens): 4 variants x
#           (no EOS, EOS) x (1 warm-up + 3 timed) rollouts of ~2.3 s, plus 4 plain loops of ~2.8 s: ~1.8 min.
#   step:   the trainer's full step was 4.2 s (B=16 x G=16 x 256 tokens): warm-up + 3 steps plus building
#           the trainer ~1 min; LoRA at the same shape (the engine merges the adapters, so its rollout
#           costs what full's does; before the engine a LoRA update took 1.7x full's) ~1.5 min; the short-
#           answers scenario: a pool of 1,024 rows x 256 tokens (~5 s at the old 57k tok/s) and 4 runs x
#           (1 + 3) rollouts of <= 2.5 s on 256 rows: ~1 min.
#   qwen:   random-weight Qwen2.5 (bench/shapes.py; written to a temporary model directory per process, 1 /
#           3 GB), full and LoRA, rollout 4x16 and step at B=4 x G=16, 128 new tokens, 1 warm-up + 1
#           timed: a 64-row decode step of these models is per-step overhead (~10-15 ms: 24 / 28 layers),
#           so a rollout is ~1.5-2 s and the rollout section's 18 rollouts ~40 s; a step with 18k tokens
#           of training ~4-8 s. ~1.5 min per 0.5B run, ~2.5 min per 1.5B run (float32 masters of 1.5B
#           weights, 18 GB, take a while to build).
set -uo pipefail
part=${1:?usage: bash bench/engine_run.sh decode|step|qwen|qwen-0.5b|qwen-1.5b [OUT]}
out=${2:-${OUT:?give an output directory or set OUT}}
mkdir -p "$out"
export PYTHONPATH=/tmp/mlxsite:src${PYTHONPATH:+:$PYTHONPATH}
export MLX_GRPO_CACHE=${MLX_GRPO_CACHE:-/tmp/mgcache}
PY=${PYTHON:-python3}
DATA=${DATA:-.gpudata/train.jsonl}
failed=0

run() {  # run NAME COMMAND...: log to OUT/NAME.log, time into OUT/times.txt, go on after a failure
  local name=$1 t0 rc
  shift
  t0=$(date +%s)
  echo "== $name: $*" | tee -a "$out/times.txt"
  "$@" > "$out/$name.log" 2>&1
  rc=$?
  echo "== $name: exit $rc after $(( $(date +%s) - t0 )) s" | tee -a "$out/times.txt"
  tail -n 25 "$out/$name.log"
  [ $rc -eq 0 ] || failed=1
}

bench() {  # bench NAME ARGS...: grpo_bench with its JSON record in OUT/NAME/
  local name=$1
  shift
  run "$name" $PY bench/grpo_bench.py --data "$DATA" --out "$out/$name" "$@"
}

qwen() {  # qwen SHAPE: full and LoRA, rollout + step
  local shape=$1 train
  for train in full lora; do
    bench "$shape-$train" --shape "$shape" --train-type "$train" --sections rollout,step --sizes 4x16 \
      --batch 4 --group 16 --max-new-tokens 128 --repeats 1
  done
}

case $part in
  decode)
    run decode_profile-smollm2 $PY bench/decode_profile.py --builders trainer,engine --rows 64,256,1024 \
      --out "$out/decode_profile-smollm2.json"
    bench rollout-16x16 --sections rollout --sizes 16x16 --repeats 3
    ;;
  step)
    bench step-full --sections step --repeats 3
    bench step-lora --sections step --repeats 3 --train-type lora
    bench short --sections short --repeats 3
    $PY - "$out" <<'PY' | tee "$out/step-summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def record(name):
    files = sorted((out / name).glob("grpo_bench-*.json"))
    return json.loads(files[-1].read_text()) if files else None
full, lora, short = record("step-full"), record("step-lora"), record("short")
if full and lora:
    f, l = full["step"], lora["step"]
    print(f"full step {f['total_s']:.2f} s (train {f['train_s']:.2f}, rollout {f['rollout_s']:.2f}); "
          f"lora step {l['total_s']:.2f} s (train {l['train_s']:.2f}, rollout {l['rollout_s']:.2f})")
    print(f"lora / full: update (train) {l['train_s'] / f['train_s']:.2f}x, whole step "
          f"{l['total_s'] / f['total_s']:.2f}x, rollout {l['rollout_s'] / f['rollout_s']:.2f}x (target <= 1.1x)")
if short:
    s = short["short"]
    print(f"short answers: {s['ratio_short_vs_full']:.2f}x (target <= {s['target_ratio']}); mean "
          f"{s['short_mean']:.1f}, max {s['short_max']}, {s['short_s']:.3f} s vs {s['full_s']:.3f} s")
PY
    ;;
  prod)  # the prod preset's own updates (bf16 compute, float32 masters): median time_step_s of updates 3-16
    run prod-preset $PY -m mlx_grpo train --config configs/prod.toml --set "dataset_path=$DATA" \
      --set max_train_samples=256 --set eval_every_updates=0 --set save_steps=0 --set log_completions_steps=0 \
      --set "output_dir=$out/prodrun"
    $PY - "$out/prodrun/prod/metrics.jsonl" <<'PY' | tee "$out/prod-summary.txt"
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])][2:]
keys = ("time_step_s", "time_rollout_s", "time_logprob_s", "time_train_s", "completion_length_mean")
print(f"prod preset, updates 3-{len(rows) + 2}: median " + ", ".join(
    f"{k} {statistics.median(r[k] for r in rows):.3f}" for k in keys if k in rows[0]))
PY
    ;;
  trl)  # TRL's GRPOTrainer on the same workload (needs trl, accelerate, datasets on the machine)
    run trl $PY bench/trl_grpo.py --model "$MLX_GRPO_CACHE/models/smollm2-135m-instruct-float32" --data "$DATA" \
      --steps 5 --out "$out/trl_grpo.json"
    ;;
  qwen-0.5b) qwen qwen2.5-0.5b ;;
  qwen-1.5b) qwen qwen2.5-1.5b ;;
  qwen) qwen qwen2.5-0.5b; qwen qwen2.5-1.5b ;;
  *) echo "engine_run.sh: unknown part '$part' (decode, step, prod, trl, qwen, qwen-0.5b, qwen-1.5b)" >&2; exit 2 ;;
esac
exit $failed
