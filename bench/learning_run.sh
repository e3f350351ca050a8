#!/bin/bash
# The docs/learning.md experiments on one GPU, each recipe as shipped: the base model's greedy accuracy, the
# training stage(s), and the trained model's greedy accuracy, all into OUT_DIR (bench/learning_report.py
# turns it into the tables). Recipes run side by side; at most three fit an 80 GB H100 at once.
#   arith:SEED    configs/arith.toml, 500 held-out problems
#   gsm8k:SEED    configs/gsm8k_sft.toml (supervised warm start), then configs/prod.toml from its checkpoint;
#                 the full GSM8K test (1,319) for the base, warm-start and trained models
#   tools:SEED    configs/arith_tools.toml (calculator);  control:SEED  configs/arith_tools_control.toml
# usage: bash bench/learning_run.sh OUT_DIR GSM8K_DIR RECIPE...   (GSM8K_DIR holds train.jsonl and test.jsonl)
# Each stage's wall time goes to OUT_DIR/<recipe>-s<seed>.<stage>.seconds.
set -u
OUT=$(mkdir -p "$1" && cd "$1" && pwd); D=$(cd "$2" && pwd); shift 2
# Each process's buffer cache is capped (bench/with_cache_limit.py): uncapped, runs side by side ran out of memory.
M="python3 bench/with_cache_limit.py 5"
latest() { ls -d "$1"/checkpoint-* | sort -t- -k2 -n | tail -1; }
timed() {  # timed NAME COMMAND...: run it, log it, record its seconds
  local name=$1 t0; shift; t0=$(date +%s)
  "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo $(( $(date +%s) - t0 )) > "$OUT/$name.seconds"; return $rc
}
run_name() { python3 -c "import tomllib, sys; print(tomllib.load(open(sys.argv[1], 'rb'))['run_name'])" "$1"; }
simple() {  # simple PRESET TAG SEED: base eval, train, trained eval on the preset's own held-out problems
  local cfg=configs/$1.toml tag=$2-s$3 runs=$OUT/runs/$2-s$3
  # the seed picks arith's splits and the worked example shown: evaluations take the run's own
  timed "$tag.base" $M eval --config "$cfg" --set seed="$3" --samples 500 -o "$OUT/$tag-base.jsonl"
  timed "$tag.train" $M train --config "$cfg" --set seed="$3" --set output_dir="$runs" || return
  timed "$tag.eval" $M eval --config "$cfg" --set seed="$3" --model "$(latest "$runs/$(run_name "$cfg")")" \
    --samples 500 -o "$OUT/$tag-trained.jsonl"
}
gsm8k() {  # gsm8k SEED: base eval, warm start, its eval, GRPO from it, trained eval (full test each time)
  local tag=gsm8k-s$1 runs=$OUT/runs/gsm8k-s$1
  local data=(--set dataset_path="$D/train.jsonl" --set eval_dataset_path="$D/test.jsonl" --set seed="$1")
  timed "$tag.base" $M eval --config configs/prod.toml "${data[@]}" --samples 1319 -o "$OUT/$tag-base.jsonl"
  timed "$tag.sft" $M sft --config configs/gsm8k_sft.toml "${data[@]}" --set output_dir="$runs" || return
  local warm; warm=$(latest "$runs/$(run_name configs/gsm8k_sft.toml)")
  timed "$tag.sfteval" $M eval --config configs/prod.toml "${data[@]}" --model "$warm" --samples 1319 \
    -o "$OUT/$tag-sft.jsonl"
  timed "$tag.train" $M train --config configs/prod.toml "${data[@]}" --set model_name="$warm" \
    --set output_dir="$runs" || return
  timed "$tag.eval" $M eval --config configs/prod.toml "${data[@]}" --model "$(latest "$runs/$(run_name configs/prod.toml)")" \
    --samples 1319 -o "$OUT/$tag-trained.jsonl"
}
first=1
for recipe in "$@"; do
  name=${recipe%%:*} seed=${recipe#*:}
  case $name in
    arith) simple arith arith "$seed" & ;;
    tools) simple arith_tools tools "$seed" & ;;
    control) simple arith_tools_control control "$seed" & ;;
    gsm8k) gsm8k "$seed" & ;;
    *) echo "unknown recipe $recipe" >&2; exit 2 ;;
  esac
  # The first process builds the CUDA kernels; processes that started together while the kernel cache was
  # being written crashed (illegal memory access, launch failures), so the others start a minute later.
  [ $first = 1 ] && sleep 60; first=0
done
wait
echo done > "$OUT/done"
