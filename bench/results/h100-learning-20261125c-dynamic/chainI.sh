#!/bin/bash
# Issue 22 lever I: the shipped GSM8K calculator recipe (gsm8k_tools_sft -> prod_tools, seed 42) with DAPO's
# dynamic sampling in the GRPO stage (groups whose rewards are all equal are dropped and more are drawn).
set -u
OUT=$1; D=$(cd "$2" && pwd); M="python3 bench/with_cache_limit.py 5"
latest() { ls -d "$1"/checkpoint-* | sort -t- -k2 -n | tail -1; }
timed() { local name=$1 t0; shift; t0=$(date +%s); "$@" > "$OUT/$name.log" 2>&1; local rc=$?; echo $(( $(date +%s) - t0 )) > "$OUT/$name.seconds"; return $rc; }
data=(--set dataset_path="$D/train.jsonl" --set eval_dataset_path="$D/test.jsonl" --set seed=42)
runs=$OUT/runs
timed sft $M sft --config configs/gsm8k_tools_sft.toml "${data[@]}" --set output_dir="$runs" || exit
warm=$(latest "$runs/gsm8k_tools_sft"); echo "warm $warm"
timed sfteval $M eval --config configs/prod_tools.toml "${data[@]}" --model "$warm" --samples 1319 -o "$OUT/sft.jsonl"
timed train $M train --config configs/prod_tools.toml "${data[@]}" --set model_name="$warm" --set output_dir="$runs" \
  --set dynamic_sampling=true || exit
timed eval $M eval --config configs/prod_tools.toml "${data[@]}" --model "$(latest "$runs/prod_tools")" --samples 1319 -o "$OUT/trained.jsonl"
echo done > $OUT/done
