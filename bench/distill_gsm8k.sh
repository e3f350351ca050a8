#!/bin/bash
# docs/distillation.md's GSM8K-with-calculator experiment on one GPU, in one machine hold:
#   1. the teacher: the shipped chain, configs/gsm8k_tools_sft.toml (supervised warm start) then
#      configs/prod_tools.toml from its checkpoint for TEACHER_MINUTES;
#   2. from the untrained base model, side by side for STUDENT_MINUTES each: on-policy distillation from that
#      teacher (configs/gsm8k_distill.toml) and GRPO alone (configs/prod_tools.toml with the base model);
#   3. greedy strict accuracy on the full GSM8K test (1,319) for the base model, the warm start (supervised
#      fine-tuning from the same start: the SFT comparison), the teacher, the student and GRPO from the base.
# Evaluations run beside the training stages that do not need them. bench/learning_report.py reads the .jsonl.
# usage: [RKL=1] bash bench/distill_gsm8k.sh OUT_DIR GSM8K_DIR SEED [TEACHER_MINUTES=14] [STUDENT_MINUTES=10]
# The student is the preset as shipped (distill_topk = 20: the top-k forward KL beside the reverse KL,
# docs/distillation.md). RKL=1 adds a third student beside them with the reverse KL alone (distill_topk = 0);
# four processes then share the GPU while the teacher is evaluated (four processes with tool episodes ran out
# of memory on an 80 GB H100 in session 28).
# Each stage's wall time goes to OUT_DIR/<stage>.seconds; OUT_DIR/done marks the end.
set -u
OUT=$(mkdir -p "$1" && cd "$1" && pwd); D=$(cd "$2" && pwd); SEED=$3; TM=${4:-14}; SM=${5:-10}
M="python3 bench/with_cache_limit.py 5"  # capped buffer caches: runs side by side share the GPU's memory
DATA=(--set dataset_path="$D/train.jsonl" --set eval_dataset_path="$D/test.jsonl" --set seed="$SEED")
RUNS=$OUT/runs
latest() { ls -d "$1"/checkpoint-* | sort -t- -k2 -n | tail -1; }
timed() {  # timed NAME COMMAND...: run it, log it, record its seconds
  local name=$1 t0; shift; t0=$(date +%s)
  "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo $(( $(date +%s) - t0 )) > "$OUT/$name.seconds"; return $rc
}
evaluate() {  # evaluate NAME [MODEL]: greedy, the full test, with the calculator as the runs use it
  local name=$1; shift
  timed "eval-$name" $M eval --config configs/prod_tools.toml "${DATA[@]}" ${1:+--model "$1"} --samples 1319 \
    -o "$OUT/$name.jsonl"
}
evaluate base &  # the preset's model: the untrained base both students start from
timed sft $M sft --config configs/gsm8k_tools_sft.toml "${DATA[@]}" --set output_dir="$RUNS" || exit 1
WARM=$(latest "$RUNS/gsm8k_tools_sft")
evaluate sft "$WARM" &
timed teacher $M train --config configs/prod_tools.toml "${DATA[@]}" --set model_name="$WARM" \
  --set output_dir="$RUNS" --set max_minutes="$TM" || exit 1
TEACHER=$(latest "$RUNS/prod_tools")
echo "$TEACHER" > "$OUT/teacher.path"
evaluate teacher "$TEACHER" &
timed student $M train --config configs/gsm8k_distill.toml "${DATA[@]}" \
  --set teacher_model="$TEACHER" --set output_dir="$RUNS/student" --set max_minutes="$SM" &
timed grpo-base $M train --config configs/prod_tools.toml "${DATA[@]}" --set output_dir="$RUNS/grpo-base" \
  --set max_minutes="$SM" &
[ "${RKL:-0}" = 1 ] && timed student-rkl $M train --config configs/gsm8k_distill.toml "${DATA[@]}" \
  --set teacher_model="$TEACHER" --set distill_topk=0 --set output_dir="$RUNS/student-rkl" \
  --set max_minutes="$SM" &
wait
evaluate student "$(latest "$RUNS/student/gsm8k_distill")" &
evaluate grpo-base "$(latest "$RUNS/grpo-base/prod_tools")" &
[ "${RKL:-0}" = 1 ] && evaluate student-rkl "$(latest "$RUNS/student-rkl/gsm8k_distill")" &
wait
touch "$OUT/done"
