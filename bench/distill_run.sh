#!/bin/bash
# docs/distillation.md's arith experiment on one GPU: a teacher trained with configs/arith.toml (seed
# TEACHER_SEED), then for each student seed, side by side: configs/arith_distill.toml from the untrained base
# model with that teacher and, for comparison, supervised fine-tuning from the same start on arith's worked
# solutions (configs/arith_tools_control_sft.toml, capped at the students' 5 minutes); then greedy exact match
# on that seed's 500 held-out problems for the base model, the teacher, the distilled student and the SFT
# model (bench/learning_report.py's intervals read the .jsonl files). GRPO's figure in the same minutes is the
# teacher run's own held-out evaluation every 25 updates (its metrics.jsonl, with the minutes elapsed).
# usage: bash bench/distill_run.sh OUT_DIR TEACHER_SEED STUDENT_SEED... [STAGE=teacher|students|evals|all]
# STAGE splits the run for machines held in short calls: `teacher` trains it, `students` trains the
# students (waiting for the teacher first), `evals` evaluates; `all` (the default) does the three in turn.
# Each stage's wall time goes to OUT_DIR/<name>.seconds.
set -u
OUT=$(mkdir -p "$1" && cd "$1" && pwd); T=$2; shift 2
M="python3 bench/with_cache_limit.py 5"
TEACHER=$OUT/runs/teacher/arith
timed() {  # timed NAME COMMAND...: run it, log it, record its seconds
  local name=$1 t0; shift; t0=$(date +%s)
  "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo $(( $(date +%s) - t0 )) > "$OUT/$name.seconds"; return $rc
}
latest() { ls -d "$1"/checkpoint-* | sort -t- -k2 -n | tail -1; }
teacher() {
  timed teacher $M train --config configs/arith.toml --set seed="$T" --set output_dir="$OUT/runs/teacher"
}
students() {
  while [ ! -f "$OUT/teacher.seconds" ]; do sleep 5; done  # the teacher's run has ended
  for s in "$@"; do
    timed "student-s$s" $M train --config configs/arith_distill.toml --set seed="$s" \
      --set teacher_model="$TEACHER" --set output_dir="$OUT/runs/student-s$s" &
    timed "sft-s$s" $M sft --config configs/arith_tools_control_sft.toml --set seed="$s" --set max_minutes=5 \
      --set output_dir="$OUT/runs/sft-s$s" &
  done
  wait
}
evals() {
  for s in "$@"; do
    ( timed "base-s$s" $M eval --config configs/arith.toml --set seed="$s" --samples 500 -o "$OUT/base-s$s.jsonl"
      timed "teacher-s$s" $M eval --config configs/arith.toml --set seed="$s" --model "$(latest "$TEACHER")" \
        --samples 500 -o "$OUT/teacher-s$s.jsonl"
      timed "student-eval-s$s" $M eval --config configs/arith_distill.toml --set seed="$s" \
        --model "$(latest "$OUT/runs/student-s$s/arith_distill")" --samples 500 -o "$OUT/student-s$s.jsonl"
      timed "sft-eval-s$s" $M eval --config configs/arith.toml --set seed="$s" \
        --model "$(latest "$OUT/runs/sft-s$s/arith-tools-control-sft")" --samples 500 -o "$OUT/sft-s$s.jsonl" ) &
  done
  wait
}
case ${STAGE:-all} in
  teacher) teacher ;;
  students) students "$@" ;;
  evals) evals "$@" ;;
  all) teacher && students "$@" && evals "$@" ;;
esac
