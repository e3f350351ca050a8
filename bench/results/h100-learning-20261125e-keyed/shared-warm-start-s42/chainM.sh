#!/bin/bash
# Issue 22, session 17: one calculator warm start (gsm8k_tools_sft), then two GRPO stages side by side from it
# (prod_tools with dynamic sampling keyed on reasoned_correctness): A with the preset's KL 0.04, B with kl_coeff 0
# (DAPO/Dr GRPO drop it; also skips the reference forward). The warm start's evaluation runs beside them.
set -u
OUT=$1; D=$(cd "$2" && pwd); SEED=$3; MIN=$4; M="python3 bench/with_cache_limit.py 5"
latest() { ls -d "$1"/checkpoint-* | sort -t- -k2 -n | tail -1; }
timed() { local name=$1 t0; shift; t0=$(date +%s); "$@" > "$OUT/$name.log" 2>&1; local rc=$?; echo $(( $(date +%s) - t0 )) > "$OUT/$name.seconds"; return $rc; }
data=(--set dataset_path="$D/train.jsonl" --set eval_dataset_path="$D/test.jsonl" --set seed=$SEED)
keyed=(--set dynamic_sampling=true --set dynamic_sampling_reward=reasoned_correctness --set max_minutes=$MIN --set max_train_samples=4096)
timed sft $M sft --config configs/gsm8k_tools_sft.toml "${data[@]}" --set output_dir="$OUT/runs" || exit
warm=$(latest "$OUT/runs/gsm8k_tools_sft"); echo "warm $warm"
timed sfteval $M eval --config configs/prod_tools.toml "${data[@]}" --model "$warm" --samples 1319 -o "$OUT/sft.jsonl" &
arm() {  # name, extra --set pairs
  local name=$1; shift
  timed train_$name $M train --config configs/prod_tools.toml "${data[@]}" --set model_name="$warm" \
    --set output_dir="$OUT/runs_$name" "${keyed[@]}" "$@" || return
  timed eval_$name $M eval --config configs/prod_tools.toml "${data[@]}" \
    --model "$(latest "$OUT/runs_$name/prod_tools")" --samples 1319 -o "$OUT/trained_$name.jsonl"
}
arm A & arm B --set kl_coeff=0 &
wait
echo done > $OUT/done
