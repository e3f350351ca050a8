#!/bin/bash
export PYTHONPATH=/tmp/mlxsite:$PWD/src PYTHONUNBUFFERED=1 MLX_GRPO_CACHE=/tmp/mgcache
rm -rf /tmp/O; mkdir -p /tmp/O
setsid nohup bash .explore/chainO.sh /tmp/O .explore/gsm8k $1 $2 > /tmp/O/driver.log 2>&1 < /dev/null &
sleep 2; echo launched O seed $1 min $2
