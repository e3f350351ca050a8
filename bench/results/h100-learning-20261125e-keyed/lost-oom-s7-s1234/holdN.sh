#!/bin/bash
export PYTHONPATH=/tmp/mlxsite:$PWD/src PYTHONUNBUFFERED=1 MLX_GRPO_CACHE=/tmp/mgcache
rm -rf /tmp/N; mkdir -p /tmp/N
for s in "$@"; do
  mkdir -p /tmp/N/s$s
  setsid nohup bash .explore/chainN.sh /tmp/N/s$s .explore/gsm8k $s 14 > /tmp/N/s$s/driver.log 2>&1 < /dev/null &
done
sleep 2; echo launched N seeds "$@"
