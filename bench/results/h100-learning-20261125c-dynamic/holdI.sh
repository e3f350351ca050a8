#!/bin/bash
export PYTHONPATH=/tmp/mlxsite:$PWD/src PYTHONUNBUFFERED=1 MLX_GRPO_CACHE=/tmp/mgcache
rm -rf /tmp/I; mkdir -p /tmp/I
setsid nohup bash .explore/chainI.sh /tmp/I .explore/gsm8k > /tmp/I/driver.log 2>&1 < /dev/null &
sleep 2; echo launched I
