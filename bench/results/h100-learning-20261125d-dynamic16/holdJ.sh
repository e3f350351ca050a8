#!/bin/bash
export PYTHONPATH=/tmp/mlxsite:$PWD/src PYTHONUNBUFFERED=1 MLX_GRPO_CACHE=/tmp/mgcache
rm -rf /tmp/J; mkdir -p /tmp/J
setsid nohup bash .explore/chainJ.sh /tmp/J .explore/gsm8k $1 > /tmp/J/driver.log 2>&1 < /dev/null &
sleep 2; echo launched J seed $1
