#!/bin/bash
# Session 21 hold 2 (background): overlap.py, a rollout and a training pass together in two threads, then in
# two processes, then threads again. Needs MLX and the default model under /tmp/mlxsite (device notes).
export PYTHONUNBUFFERED=1 MLX_GRPO_CACHE=/tmp/mgcache
R=$PWD; O=$1; mkdir -p $O /tmp/gsm8k
D=${DATA:-/tmp/gsm8k/train.jsonl}; [ -f $D ] || cp $R/.explore/gsm8k/train.jsonl $D
rm -rf /tmp/src21; cp -r $R/src /tmp/src21; cp -r $R/bench /tmp/bench21  # each device call syncs the checkout again
run() { n=$1; shift; s0=$(date +%s); (cd /tmp && PYTHONPATH=/tmp/mlxsite:/tmp/src21 timeout ${T:-400} "$@" > $O/$n.log 2>&1); echo "$n rc=$? $(( $(date +%s) - s0 ))s" >> $O/driver.log; }
echo start $(date) > $O/driver.log
cd /tmp && mkdir -p /tmp/ovl && cp -r /tmp/bench21 /tmp/ovl/bench
run threads1 bash -c "cd /tmp/ovl && python3 bench/results/gpu-speed-20261125i/overlap.py $D threads"
run processes bash -c "cd /tmp/ovl && python3 bench/results/gpu-speed-20261125i/overlap.py $D processes 90"
run threads2 bash -c "cd /tmp/ovl && python3 bench/results/gpu-speed-20261125i/overlap.py $D threads"
echo done $(date) >> $O/driver.log; touch $O/done
