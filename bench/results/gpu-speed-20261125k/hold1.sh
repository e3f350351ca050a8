#!/bin/bash
# Session 23 hold 1 (background): shardprobe.py with 1, 2 and 4 rollout processes.
# Needs MLX and the default model under /tmp/mlxsite (device notes).
export PYTHONUNBUFFERED=1 MLX_GRPO_CACHE=/tmp/mgcache
R=$PWD; O=$1; mkdir -p $O /tmp/gsm8k
D=/tmp/gsm8k/train.jsonl; [ -f $D ] || cp $R/.explore/gsm8k/train.jsonl $D
rm -rf /tmp/src23 /tmp/bench23; cp -r $R/src /tmp/src23; cp -r $R/bench /tmp/bench23
echo start $(date) > $O/driver.log
cd /tmp/bench23
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > $O/probe.smi 2>/dev/null & smi=$!
PYTHONPATH=/tmp/mlxsite:/tmp/src23:/tmp/bench23 timeout 560 python3 results/gpu-speed-20261125k/shardprobe.py $D 1,2,4 5 > $O/probe.log 2>&1
echo "probe rc=$? gpu-max-MiB=$(sort -n $O/probe.smi | tail -1)" >> $O/driver.log; kill $smi
echo done $(date) >> $O/driver.log; touch $O/done
