#!/bin/bash
# Issue 22, session 18: the calculator chain exactly as shipped (gsm8k_tools_sft -> prod_tools) for two seeds on one
# H100: both warm starts side by side, then both GRPO stages side by side (as seed 42's run A ran beside B). The warm
# starts' evaluations run one after the other beside them (two evaluations beside two GRPO stages ran out of memory).
set -u
OUT=$1; D=$(cd "$2" && pwd); S1=$3; S2=$4; M="python3 bench/with_cache_limit.py 5"
latest() { ls -d "$1"/checkpoint-* | sort -t- -k2 -n | tail -1; }
timed() { local name=$1 t0; shift; t0=$(date +%s); "$@" > "$OUT/$name.log" 2>&1; local rc=$?; echo $(( $(date +%s) - t0 )) > "$OUT/$name.seconds"; return $rc; }
data() { echo --set dataset_path="$D/train.jsonl" --set eval_dataset_path="$D/test.jsonl" --set seed=$1; }
sft() { timed sft_s$1 $M sft --config configs/gsm8k_tools_sft.toml $(data $1) --set output_dir="$OUT/runs_s$1"; }
sfteval() { timed sfteval_s$1 $M eval --config configs/prod_tools.toml $(data $1) --model "$(latest "$OUT/runs_s$1/gsm8k_tools_sft")" --samples 1319 -o "$OUT/sft_s$1.jsonl"; }
grpo() {
  timed train_s$1 $M train --config configs/prod_tools.toml $(data $1) --set model_name="$(latest "$OUT/runs_s$1/gsm8k_tools_sft")" \
    --set output_dir="$OUT/runs_s$1" || return
  timed eval_s$1 $M eval --config configs/prod_tools.toml $(data $1) --model "$(latest "$OUT/runs_s$1/prod_tools")" --samples 1319 -o "$OUT/trained_s$1.jsonl"
}
sft $S1 & sft $S2 & wait
echo "warm starts: $(latest "$OUT/runs_s$S1/gsm8k_tools_sft") $(latest "$OUT/runs_s$S2/gsm8k_tools_sft")"
grpo $S1 & grpo $S2 & { sfteval $S1; sfteval $S2; } &
wait
echo done > $OUT/done
