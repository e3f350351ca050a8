#!/bin/bash
# a second short hold (session 43): the standard step (grpo_bench 16x16, 3 steps after a warm-up) at HEAD and at d965fb4
# interleaved, twice each, then HEAD with MLX's CUDA graphs off; results under $OUT
export PYTHONUNBUFFERED=1 MLX_GRPO_CACHE=/tmp/mgc0
T0=$(date +%s); D=$PWD/.gsm8k; B=/tmp/r2; mkdir -p $B
mkdir -p /tmp/base && tar xzf .gpujobs/base.tgz -C /tmp/base; rm -rf /tmp/clean && mkdir /tmp/clean && cp -a src bench configs pyproject.toml /tmp/clean/
S="--data $D/train.jsonl --sections step --sizes 16x16 --repeats 3 --warmup 1"
st() { (cd /tmp/$2 && timeout 150 env PYTHONPATH=/tmp/mlxsite:/tmp/$2/src $3 python3 bench/grpo_bench.py $S --out $B/$1 > $B/$1.log 2>&1)
  echo "$1 $(( $(date +%s) - T0 ))" >> $B/seconds.txt; grep -o '"total_s": [0-9.]*' $B/$1/*.json | head -1; }
st head-a clean; st base-a base; st head-b clean; st base-b base
[ $(( $(date +%s) - T0 )) -lt 260 ] && st head-nographs clean MLX_USE_CUDA_GRAPHS=0
cat $B/seconds.txt
tar czf $OUT/r2.tgz -C /tmp r2
