#!/bin/bash
# Issue 22, session 17: the calculator warm start (gsm8k_tools_sft), then GRPO (prod_tools with dynamic sampling keyed on
# reasoned_correctness, max_minutes $4); the warm start's evaluation runs beside GRPO. One seed per call.
set -u
OUT=$1; D=$(cd "$2" && pwd); SEED=$3; MIN=$4; M="python3 bench/with_cache_limit.py 5"
mkdir -p "$OUT"
latest() { ls -d "$1"/checkpoint-* | sort -t- -k2 -n | tail -1; }
timed() { local name=$1 t0; shift; t0=$(date +%s); "$@" > "$OUT/$name.log" 2>&1; local rc=$?; echo $(( $(date +%s) - t0 )) > "$OUT/$name.seconds"; return $rc; }
data=(--set dataset_path="$D/train.jsonl" --set eval_dataset_path="$D/test.jsonl" --set seed=$SEED)
keyed=(--set dynamic_sampling=true --set dynamic_sampling_reward=reasoned_correctness --set max_minutes=$MIN --set max_train_samples=4096)
timed sft $M sft --config configs/gsm8k_tools_sft.toml "${data[@]}" --set output_dir="$OUT/runs" || exit
warm=$(latest "$OUT/runs/gsm8k_tools_sft"); echo "warm $warm"
timed sfteval $M eval --config configs/prod_tools.toml "${data[@]}" --model "$warm" --samples 1319 -o "$OUT/sft.jsonl" &
timed train $M train --config configs/prod_tools.toml "${data[@]}" --set model_name="$warm" --set output_dir="$OUT/runs" "${keyed[@]}" &&
timed eval $M eval --config configs/prod_tools.toml "${data[@]}" --model "$(latest "$OUT/runs/prod_tools")" --samples 1319 -o "$OUT/trained.jsonl"
wait
echo done > $OUT/done
