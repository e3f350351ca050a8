#!/bin/bash
# The docs/learning.md experiments on one GPU, each recipe as shipped: the base model's greedy accuracy, the
# training stage(s), and the trained model's greedy accuracy, all into OUT_DIR (bench/learning_report.py
# turns it into the tables). Recipes run side by side; at most three processes fit an 80 GB H100 at once, and a
# GSM8K chain is two while its warm start's evaluation runs beside its GRPO stage: one GSM8K chain per GPU (two
# chains with their evaluations ran out of device memory in session 28).
#   arith:SEED    configs/arith.toml, 500 held-out problems
#   gsm8k:SEED    configs/gsm8k_sft.toml (supervised warm start), then configs/prod.toml from its checkpoint;
#                 the full GSM8K test (1,319) for the base, warm-start and trained models
#   tools:SEED    configs/arith_tools_sft.toml (warm start calling the calculator), then configs/arith_tools.toml
#   control:SEED  the same without the tool: configs/arith_tools_control_sft.toml, configs/arith_tools_control.toml
#   gsm8k_tools:SEED  gsm8k with the calculator: configs/gsm8k_tools_sft.toml, then configs/prod_tools.toml
#   tools_nosft:SEED / control_nosft:SEED  arith_tools.toml / arith_tools_control.toml from the base model
# usage: bash bench/learning_run.sh OUT_DIR GSM8K_DIR RECIPE...   (GSM8K_DIR holds train.jsonl and test.jsonl)
# On a machine of several GPUs, one invocation per GPU, each with CUDA_VISIBLE_DEVICES and its own
# MLX_GRPO_CACHE (its own kernel cache: processes writing one cache at once crashed).
# Each stage's wall time goes to OUT_DIR/<recipe>-s<seed>.<stage>.seconds. GRPO_SET="key=value ..." adds --set items
# to the GSM8K chains' GRPO stage only (e.g. GRPO_SET=lookahead=4: a rollout timing setting); items are split on
# spaces (a value cannot hold one) and never globbed.
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
gsm8k() {  # gsm8k SEED SFT_PRESET GRPO_PRESET TAG: base eval, warm start, its eval, GRPO from it, trained eval
  local tag=$4-s$1 runs=$OUT/runs/$4-s$1 sft=configs/$2.toml grpo=configs/$3.toml
  local data=(--set dataset_path="$D/train.jsonl" --set eval_dataset_path="$D/test.jsonl" --set seed="$1") extra=()
  local items; read -ra items <<< "${GRPO_SET:-}"
  for item in ${items[@]+"${items[@]}"}; do extra+=(--set "$item"); done
  # BASE=0 skips the base model's evaluation (~2 GPU minutes) when a hold is short
  [ "${BASE:-1}" = 1 ] && timed "$tag.base" $M eval --config "$grpo" "${data[@]}" --samples 1319 -o "$OUT/$tag-base.jsonl"
  timed "$tag.sft" $M sft --config "$sft" "${data[@]}" --set output_dir="$runs" || return
  local warm; warm=$(latest "$runs/$(run_name "$sft")")
  # the warm start's evaluation runs beside the GRPO stage, off the chain's critical path (~1.5 GPU minutes)
  timed "$tag.sfteval" $M eval --config "$grpo" "${data[@]}" --model "$warm" --samples 1319 -o "$OUT/$tag-sft.jsonl" &
  timed "$tag.train" $M train --config "$grpo" "${data[@]}" ${extra[@]+"${extra[@]}"} --set model_name="$warm" \
    --set output_dir="$runs" || return
  timed "$tag.eval" $M eval --config "$grpo" "${data[@]}" --model "$(latest "$runs/$(run_name "$grpo")")" \
    --samples 1319 -o "$OUT/$tag-trained.jsonl"
  wait
}
warm() {  # warm SFT_PRESET GRPO_PRESET TAG SEED: base eval, warm start, its eval, GRPO from it, trained eval (arith)
  local tag=$3-s$4 runs=$OUT/runs/$3-s$4 sft=configs/$1.toml grpo=configs/$2.toml
  [ "${BASE:-1}" = 1 ] && timed "$tag.base" $M eval --config "$grpo" --set seed="$4" --samples 500 -o "$OUT/$tag-base.jsonl"
  timed "$tag.sft" $M sft --config "$sft" --set seed="$4" --set output_dir="$runs" || return
  local start; start=$(latest "$runs/$(run_name "$sft")")
  timed "$tag.sfteval" $M eval --config "$grpo" --set seed="$4" --model "$start" --samples 500 -o "$OUT/$tag-sft.jsonl"
  timed "$tag.train" $M train --config "$grpo" --set seed="$4" --set model_name="$start" --set output_dir="$runs" || return
  timed "$tag.eval" $M eval --config "$grpo" --set seed="$4" --model "$(latest "$runs/$(run_name "$grpo")")" \
    --samples 500 -o "$OUT/$tag-trained.jsonl"
}
first=1
for recipe in "$@"; do
  name=${recipe%%:*} seed=${recipe#*:}
  case $name in
    arith) simple arith arith "$seed" & ;;
    tools) warm arith_tools_sft arith_tools tools "$seed" & ;;
    control) warm arith_tools_control_sft arith_tools_control control "$seed" & ;;
    tools_nosft) simple arith_tools tools_nosft "$seed" & ;;
    control_nosft) simple arith_tools_control control_nosft "$seed" & ;;
    gsm8k) gsm8k "$seed" gsm8k_sft prod gsm8k & ;;
    gsm8k_tools) gsm8k "$seed" gsm8k_tools_sft prod_tools gsm8k_tools & ;;
    *) echo "unknown recipe $recipe" >&2; exit 2 ;;
  esac
  # The first process builds the CUDA kernels; processes that started together while the kernel cache was
  # being written crashed (illegal memory access, launch failures), so the others start a minute later.
  [ $first = 1 ] && sleep 60; first=0
done
wait
echo done > "$OUT/done"
