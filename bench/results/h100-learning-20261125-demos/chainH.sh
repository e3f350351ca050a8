#!/bin/bash
set -u
OUT=$1; D=$(cd "$2" && pwd); M="python3 bench/with_cache_limit.py 5"
latest() { ls -d "$1"/checkpoint-* | sort -t- -k2 -n | tail -1; }
timed() { local name=$1 t0; shift; t0=$(date +%s); "$@" > "$OUT/$name.log" 2>&1; local rc=$?; echo $(( $(date +%s) - t0 )) > "$OUT/$name.seconds"; return $rc; }
data=(--set dataset_path="$D/train.jsonl" --set eval_dataset_path="$D/test.jsonl" --set seed=42)
runs=$OUT/runs
timed sft $M sft --config configs/gsm8k_sft.toml "${data[@]}" --set num_epochs=1 --set output_dir="$runs" || exit
warm=$(latest "$runs/gsm8k_sft"); echo "warm $warm"
( sleep 90; timed sfteval $M eval --config configs/prod.toml "${data[@]}" --model "$warm" --samples 1319 -o "$OUT/sft.jsonl" ) &
timed train $M train --config configs/prod.toml "${data[@]}" --set model_name="$warm" --set output_dir="$runs" \
  --set demonstrations=zero_groups --set demo_reward=reasoned_correctness --set max_minutes=${GRPO_MIN:-16} \
  --set max_train_samples=0 --set use_compile=true --set compile_update=true || exit
timed eval $M eval --config configs/prod.toml "${data[@]}" --model "$(latest "$runs/prod")" --samples 1319 -o "$OUT/trained.jsonl"
wait; echo done > $OUT/done
