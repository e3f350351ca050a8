#!/bin/bash
export PYTHONPATH=/tmp/mlxsite:$PWD/src PYTHONUNBUFFERED=1 MLX_GRPO_CACHE=/tmp/mgcache
rm -rf /tmp/P; mkdir -p /tmp/P
setsid nohup bash .explore/chainP.sh /tmp/P .explore/gsm8k $1 $2 > /tmp/P/driver.log 2>&1 < /dev/null &
sleep 2; echo launched P seeds $1 $2
