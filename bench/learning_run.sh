#!/bin/bash
# The docs/learning.md experiments on one GPU: greedy accuracy of the base model, a training run, and the
# trained model's accuracy, for configs/arith.toml (500 held-out arith problems) and configs/prod.toml
# (the full GSM8K test, 1,319 questions), both runs side by side on the one GPU.
# usage: bash bench/learning_run.sh GSM8K_DIR OUT_DIR   (GSM8K_DIR holds train.jsonl and test.jsonl)
set -u
D=$(cd "$1" && pwd); OUT=$2
mkdir -p "$OUT"
# Each process's buffer cache is capped at 6 GiB (bench/with_cache_limit.py): uncapped, the two runs
# side by side ran out of the H100's 80 GB.
M="python3 bench/with_cache_limit.py 6"
latest() { ls -d "$1"/checkpoint-* | sort -t- -k2 -n | tail -1; }
arith() {
  $M eval --config configs/arith.toml --samples 500 -o "$OUT/arith-base.jsonl"
  $M train --config configs/arith.toml --set output_dir="$OUT/runs"
  $M eval --config configs/arith.toml --model "$(latest "$OUT/runs/arith")" --samples 500 -o "$OUT/arith-trained.jsonl"
}
gsm8k() {
  local test=(--set eval_dataset_path="$D/test.jsonl")
  $M eval --config configs/prod.toml "${test[@]}" --samples 1319 -o "$OUT/gsm8k-base.jsonl"
  $M train --config configs/prod.toml "${test[@]}" --set dataset_path="$D/train.jsonl" --set output_dir="$OUT/runs"
  $M eval --config configs/prod.toml "${test[@]}" --model "$(latest "$OUT/runs/prod")" --samples 1319 \
    -o "$OUT/gsm8k-trained.jsonl"
}
date +%s > "$OUT/start"
arith > "$OUT/arith.log" 2>&1 &
gsm8k > "$OUT/gsm8k.log" 2>&1 &
wait
date +%s > "$OUT/end"
