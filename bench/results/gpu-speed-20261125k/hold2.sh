#!/bin/bash
# Session 23 hold 2 (background): busyprobe.py for the engine, then decode_graph.
export PYTHONUNBUFFERED=1 MLX_GRPO_CACHE=/tmp/mgcache
R=$PWD; O=$1; mkdir -p $O /tmp/gsm8k
D=/tmp/gsm8k/train.jsonl; [ -f $D ] || cp $R/.explore/gsm8k/train.jsonl $D
rm -rf /tmp/src23 /tmp/bench23; cp -r $R/src /tmp/src23; cp -r $R/bench /tmp/bench23
echo start $(date) > $O/driver.log
cd /tmp/bench23
for v in engine graph; do
  PYTHONPATH=/tmp/mlxsite:/tmp/src23:/tmp/bench23 timeout 280 python3 results/gpu-speed-20261125k/busyprobe.py $D $O $v > $O/busy-$v.log 2>&1
  echo "busy-$v rc=$?" >> $O/driver.log
done
echo done $(date) >> $O/driver.log; touch $O/done
