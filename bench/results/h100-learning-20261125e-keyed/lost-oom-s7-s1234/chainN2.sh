#!/bin/bash
# Resume chainN after its GRPO stages died of OOM beside two evaluations: GRPO + eval from the existing warm start.
set -u
OUT=$1; D=$(cd "$2" && pwd); SEED=$3; MIN=$4; M="python3 bench/with_cache_limit.py 5"
latest() { ls -d "$1"/checkpoint-* | sort -t- -k2 -n | tail -1; }
timed() { local name=$1 t0; shift; t0=$(date +%s); "$@" > "$OUT/$name.log" 2>&1; local rc=$?; echo $(( $(date +%s) - t0 )) > "$OUT/$name.seconds"; return $rc; }
data=(--set dataset_path="$D/train.jsonl" --set eval_dataset_path="$D/test.jsonl" --set seed=$SEED)
keyed=(--set dynamic_sampling=true --set dynamic_sampling_reward=reasoned_correctness --set max_minutes=$MIN --set max_train_samples=4096)
warm=$(latest "$OUT/runs/gsm8k_tools_sft"); rm -f "$OUT/done"; rm -rf "$OUT/runs/prod_tools"
timed train $M train --config configs/prod_tools.toml "${data[@]}" --set model_name="$warm" --set output_dir="$OUT/runs" "${keyed[@]}" &&
timed eval $M eval --config configs/prod_tools.toml "${data[@]}" --model "$(latest "$OUT/runs/prod_tools")" --samples 1319 -o "$OUT/trained.jsonl"
echo done > $OUT/done
