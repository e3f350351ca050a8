#!/bin/bash
# Session 22 hold 3 (background, a fresh machine): async_bench modes 1p, 0, 1p with the rollout weights sent
# through a shared file (the first 1p run builds the kernels; the 0 and second 1p runs are the comparison).
# Needs MLX and the default model under /tmp/mlxsite and TRL's wheels in .gpuwheels/extra (device notes).
export PYTHONUNBUFFERED=1 MLX_GRPO_CACHE=/tmp/mgcache
R=$PWD; O=$1; mkdir -p $O /tmp/gsm8k
# the data and src/ outside the checkout: each device call syncs the checkout again
D=/tmp/gsm8k/train.jsonl; [ -f $D ] || cp $R/.explore/gsm8k/train.jsonl $D
rm -rf /tmp/src22 /tmp/bench22; cp -r $R/src /tmp/src22; cp -r $R/bench /tmp/bench22
A="--data $D --sections step --repeats 3 --warmup 2"; C="--set compile_update=true --set use_compile=true"
run() { n=$1; S=$2; shift 2; s0=$(date +%s)
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > $O/$n.smi 2>/dev/null & smi=$!
  PYTHONPATH=/tmp/mlxsite:$S timeout ${T:-300} "$@" > $O/$n.log 2>&1; rc=$?; kill $smi
  echo "$n rc=$rc $(( $(date +%s) - s0 ))s gpu-max-MiB=$(sort -n $O/$n.smi | tail -1)" >> $O/driver.log; }
echo start $(date) > $O/driver.log
cd /tmp/bench22
i=0; for m in 1p 0 1p; do i=$((i+1)); T=420 run async$m-$i /tmp/src22 python3 async_bench.py --data $D --updates 20 --modes $m $C --out $O/async$m-$i; done
echo done $(date) >> $O/driver.log; touch $O/done
