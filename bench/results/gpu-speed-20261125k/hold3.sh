#!/bin/bash
# Session 23 hold 3 (background): attnsplit.py, the split fused decode attention kernel against the shipped one.
export PYTHONUNBUFFERED=1 MLX_GRPO_CACHE=/tmp/mgcache
R=$PWD; O=$1; mkdir -p $O
rm -rf /tmp/src23 /tmp/bench23; cp -r $R/src /tmp/src23; cp -r $R/bench /tmp/bench23
echo start $(date) > $O/driver.log
cd /tmp/bench23
PYTHONPATH=/tmp/mlxsite:/tmp/src23 timeout 400 python3 results/gpu-speed-20261125k/attnsplit.py > $O/attnsplit.log 2>&1
echo "attnsplit rc=$?" >> $O/driver.log
echo done $(date) >> $O/driver.log; touch $O/done
