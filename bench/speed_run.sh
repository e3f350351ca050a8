#!/bin/bash
# Issue 25's figures in one GPU command (< 10 min on an H100): the decode step before/after decode_graph, the
# standard step eager vs with the speed options, the training pass split, TRL's GRPOTrainer in the same
# sitting, and the Qwen2.5 shapes (full and LoRA) with the speed options. Run from the repository root; MLX
# from PYTHONPATH (/tmp/mlxsite as engine_run.sh), GSM8K train split in $DATA. Logs, JSON records and
# times.txt go under OUT; summary.txt holds the lines BENCHMARKS.md needs.
#
#   bash bench/speed_run.sh [OUT]
#
# Estimates (from engine_run.sh's times.txt, 2026-11-23): decode_profile with 2 builders x 64/256/1024 rows
# ~70 s; standard step + split ~90 s; the same step with the options ~80 s (first-shape compiles); TRL 5
# steps ~90 s (skipped with a line when trl is not installed); Qwen 0.5B / 1.5B, full and LoRA, step only
# (B=4 x G=16 x 128) ~35-60 s each. Every command has its own timeout, so the whole stays under 570 s.
set -uo pipefail
out=${1:-${OUT:?give an output directory or set OUT}}
mkdir -p "$out"
export PYTHONPATH=/tmp/mlxsite:src${PYTHONPATH:+:$PYTHONPATH}
export MLX_GRPO_CACHE=${MLX_GRPO_CACHE:-/tmp/mgcache}
PY=${PYTHON:-python3}
DATA=${DATA:-.gpudata/train.jsonl}
# decode_graph stays out: it decoded slower on the H100 (BENCHMARKS.md); decode_profile compares it
ON=(--set compile_update=true --set use_compile=true)
failed=0
begin=$(date +%s)

run() {  # run NAME SECONDS COMMAND...: log to OUT/NAME.log, time into OUT/times.txt, go on after a failure
  local name=$1 limit=$2 t0 rc left
  shift 2
  left=$(( 570 - ($(date +%s) - begin) ))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 10 ]; then echo "== $name: skipped, out of time" | tee -a "$out/times.txt"; return; fi
  t0=$(date +%s)
  echo "== $name: $*" | tee -a "$out/times.txt"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  rc=$?
  echo "== $name: exit $rc after $(( $(date +%s) - t0 )) s" | tee -a "$out/times.txt"
  tail -n 12 "$out/$name.log"
  [ $rc -eq 0 ] || failed=1
}

bench() {  # bench NAME SECONDS ARGS...: grpo_bench with its JSON record in OUT/NAME/
  local name=$1 limit=$2
  shift 2
  run "$name" "$limit" $PY bench/grpo_bench.py --data "$DATA" --out "$out/$name" "$@"
}

run decode_profile 120 $PY bench/decode_profile.py --builders engine,graph --rows 64,256,1024 --steps 24 \
  --out "$out/decode_profile.json"
# a fresh machine builds its CUDA kernels during the first step (~2 minutes)
bench step-eager 200 --sections split,step --repeats 3
bench step-on 120 --sections step --repeats 3 "${ON[@]}"
if $PY -c "import trl" 2>/dev/null; then
  run trl 150 $PY bench/trl_grpo.py --model "$MLX_GRPO_CACHE/models/smollm2-135m-instruct-float32" --data "$DATA" \
    --steps 5 --out "$out/trl_grpo.json"
else
  echo "== trl: not installed on this machine (pip install trl accelerate datasets); skipped" | tee -a "$out/times.txt"
fi
for shape in qwen2.5-0.5b qwen2.5-1.5b; do
  for train in full lora; do
    bench "$shape-$train" 90 --shape "$shape" --train-type "$train" --sections step --batch 4 --group 16 \
      --max-new-tokens 128 --repeats 1 "${ON[@]}"
  done
done

$PY - "$out" <<'PY' | tee "$out/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def record(name):
    files = sorted((out / name).glob("grpo_bench-*.json"))
    return json.loads(files[-1].read_text()) if files else None
profile = out / "decode_profile.json"
if profile.is_file():
    for r in json.loads(profile.read_text())["rows"]:
        print(f"decode {r['builder']:6} {r['rows']:5} rows: steady {r['steady_ms']:.2f} ms/step, build "
              f"{r['build_ms']:.2f} + dispatch {r['dispatch_ms']:.2f} ms host, {r['primitives']} primitives")
def step(s):
    return (f"{s['total_s']:.2f} s = rollout {s['rollout_s']:.2f} + log-probs {s['logprob_s']:.2f} + train "
            f"{s['train_s']:.2f}; rollout {s['tokens'] / s['rollout_s']:,.0f} tok/s; peak {s['peak_memory_gb']:.1f} GB")
eager, on = record("step-eager"), record("step-on")
for name, rec in (("eager", eager), ("compile_update + use_compile", on)):
    if rec and "step" in rec:
        print(f"standard step, {name}: {step(rec['step'])}")
if eager and "split" in eager:
    p = eager["split"]
    print(f"training pass split: forward {p['forward_s']:.3f}, backward {p['backward_eager_s']:.3f} eager / "
          f"{p['backward_compiled_s']:.3f} compiled, clip {p['clip_s']:.3f}, optimizer {p['optimizer_s']:.3f}, "
          f"master cast {p['master_cast_s']:.3f}; update {p['update_eager_s']:.3f} eager / "
          f"{p['update_compiled_s']:.3f} compiled")
trl = out / "trl_grpo.json"
if trl.is_file():
    t = json.loads(trl.read_text())
    per_step = t.get("s_per_step")
    print(f"TRL GRPOTrainer: {per_step:.2f} s/step ({t.get('measured_steps')}), median {t.get('s_per_step_median'):.2f}; "
          f"mean completion {t.get('completion_mean_length')}; peak {t.get('peak_memory_gb')} GB")
    if per_step:
        for name, rec in (("eager", eager), ("options on", on)):
            if rec and "step" in rec:
                print(f"vs TRL, {name}: {per_step / rec['step']['total_s']:.2f}x")
for shape in ("qwen2.5-0.5b", "qwen2.5-1.5b"):
    full, lora = record(f"{shape}-full"), record(f"{shape}-lora")
    for train, rec in (("full", full), ("lora", lora)):
        if rec and "step" in rec:
            print(f"{shape} {train}: step {step(rec['step'])}")
    if full and lora and "step" in full and "step" in lora:
        print(f"{shape} lora / full step: {lora['step']['total_s'] / full['step']['total_s']:.2f}x (target <= 1.1x)")
PY
exit $failed
