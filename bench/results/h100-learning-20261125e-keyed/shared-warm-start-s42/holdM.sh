#!/bin/bash
export PYTHONPATH=/tmp/mlxsite:$PWD/src PYTHONUNBUFFERED=1 MLX_GRPO_CACHE=/tmp/mgcache
rm -rf /tmp/M; mkdir -p /tmp/M
setsid nohup bash .explore/chainM.sh /tmp/M .explore/gsm8k $1 $2 > /tmp/M/driver.log 2>&1 < /dev/null &
sleep 2; echo launched M seed $1 min $2
