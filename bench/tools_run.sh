#!/bin/bash
# The docs/learning.md "Tools" demonstration on one GPU: configs/arith.toml and configs/arith_tools.toml
# trained side by side for the same minutes (max_minutes), then the base and trained models of both
# evaluated greedily on the same 500 held-out problems (the tool run's evaluations call the calculator).
# usage: bash bench/tools_run.sh train OUT_DIR MINUTES   then   bash bench/tools_run.sh eval OUT_DIR
# (two parts, so each fits one device call; run them on the same machine, back to back)
set -u
OUT=$2
mkdir -p "$OUT"
M="python3 bench/with_cache_limit.py 6"
latest() { ls -d "$1"/checkpoint-* | sort -t- -k2 -n | tail -1; }
case $1 in
train)
  for preset in arith arith_tools; do
    $M train --config configs/$preset.toml --set output_dir="$OUT/runs" --set max_minutes="$3" \
      --set eval_every_updates=0 --set save_steps=0 > "$OUT/$preset-train.log" 2>&1 &
  done
  wait ;;
eval)
  for preset in arith arith_tools; do
    run=$(python3 -c "import tomllib; print(tomllib.load(open('configs/$preset.toml', 'rb'))['run_name'])")
    $M eval --config configs/$preset.toml --samples 500 -o "$OUT/$preset-base.jsonl" > "$OUT/$preset-base.log" 2>&1 &
    $M eval --config configs/$preset.toml --model "$(latest "$OUT/runs/$run")" --samples 500 \
      -o "$OUT/$preset-trained.jsonl" > "$OUT/$preset-trained.log" 2>&1 &
  done
  wait ;;
esac
