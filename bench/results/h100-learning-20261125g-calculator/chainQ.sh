#!/bin/bash
# Issue 22, session 18: the calculator recipe and its control over seeds 7 and 1234, as shipped, on one H100
# (bench/learning_run.sh, no base evaluations). At most three runs at once: the calculator's GRPO peaks at
# ~24 GB, the control's at ~18 GB, so the two calculator chains run one after the other beside the controls.
set -u
OUT=$1; D=$2
mkdir -p "$OUT/control" "$OUT/tools"
BASE=0 bash bench/learning_run.sh "$OUT/control" "$D" control:7 control:1234 > "$OUT/control.driver.log" 2>&1 &
{ sleep 60; BASE=0 bash bench/learning_run.sh "$OUT/tools" "$D" tools:7; rm -f "$OUT/tools/done"
  BASE=0 bash bench/learning_run.sh "$OUT/tools" "$D" tools:1234; } > "$OUT/tools.driver.log" 2>&1 &
wait
echo done > "$OUT/done"
