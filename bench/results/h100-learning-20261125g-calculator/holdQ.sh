#!/bin/bash
export PYTHONPATH=/tmp/mlxsite:$PWD/src PYTHONUNBUFFERED=1 MLX_GRPO_CACHE=/tmp/mgcache
rm -rf /tmp/Q; mkdir -p /tmp/Q
setsid nohup bash .explore/chainQ.sh /tmp/Q .explore/gsm8k > /tmp/Q/driver.log 2>&1 < /dev/null &
sleep 2; echo launched Q
