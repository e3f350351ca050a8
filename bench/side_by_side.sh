#!/bin/bash
# Host contention check for bench/dp_bench.py's figures: one single-GPU `mlx-grpo train` run alone, then
# two independent ones side by side on GPUs 0 and 1 (no data parallelism). Same seed and data, so every
# run samples the same tokens and does the same work: a pair slower than the run alone would be the
# host's cost, not the collectives'. Prints each run's mean figures over updates 3-10.
#   bash bench/side_by_side.sh path/to/gsm8k/train.jsonl [output_dir]
set -euo pipefail
data=$1
out=${2:-/tmp/side-by-side}
common=(--set "dataset_path=$data" --set model_dtype=bfloat16 --set num_generations=16 --set max_new_tokens=256
        --set kl_coeff=0.04 --set save_steps=0 --set batch_size=16 --set max_train_samples=160 --set warmup_ratio=0
        --set log_completions_steps=0 --set "output_dir=$out")
CUDA_VISIBLE_DEVICES=0 python3 -m mlx_grpo train "${common[@]}" --set run_name=alone > "$out.alone.log" 2>&1
CUDA_VISIBLE_DEVICES=0 python3 -m mlx_grpo train "${common[@]}" --set run_name=pair0 > "$out.pair0.log" 2>&1 &
CUDA_VISIBLE_DEVICES=1 python3 -m mlx_grpo train "${common[@]}" --set run_name=pair1 > "$out.pair1.log" 2>&1 &
wait
python3 - "$out" <<'PY'
import json, statistics, sys
for name in ("alone", "pair0", "pair1"):
    rows = [json.loads(line) for line in open(f"{sys.argv[1]}/{name}/metrics.jsonl")][2:]
    print(name, len(rows), {k: round(statistics.mean(r[k] for r in rows), 3) for k in
          ("time_step_s", "time_rollout_s", "time_logprob_s", "time_train_s", "completion_length_mean")})
PY
