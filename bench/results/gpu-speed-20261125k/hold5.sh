#!/bin/bash
# Session 23 hold 5 (background, a fresh machine): the run's own throughput with the split attention kernel,
# async_bench modes 0 (a 4-update warm-up that builds the kernels, then 20 updates) and 1p (20), compiled step
# as in the ninth and tenth sittings, then TRL: one sitting.
# Needs MLX and the default model under /tmp/mlxsite, TRL's wheels in .gpuwheels/extra, GSM8K in .explore/gsm8k.
export PYTHONUNBUFFERED=1 MLX_GRPO_CACHE=/tmp/mgcache
R=$PWD; O=$1; mkdir -p $O /tmp/gsm8k
D=/tmp/gsm8k/train.jsonl; [ -f $D ] || cp $R/.explore/gsm8k/train.jsonl $D
rm -rf /tmp/src23 /tmp/bench23; cp -r $R/src /tmp/src23; cp -r $R/bench /tmp/bench23
C="--set compile_update=true --set use_compile=true"
run() { n=$1; S=$2; shift 2; s0=$(date +%s)
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > $O/$n.smi 2>/dev/null & smi=$!
  PYTHONPATH=/tmp/mlxsite:$S timeout ${T:-300} "$@" > $O/$n.log 2>&1; rc=$?; kill $smi
  echo "$n rc=$rc $(( $(date +%s) - s0 ))s gpu-max-MiB=$(sort -n $O/$n.smi | tail -1)" >> $O/driver.log; }
echo start $(date) > $O/driver.log
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $R/.gpuwheels/extra/*.whl >> $O/driver.log 2>&1 && echo extra-installed >> $O/driver.log
cd /tmp/bench23
T=240 run warm /tmp/src23 python3 async_bench.py --data $D --updates 4 --modes 0 $C --out $O/warm
T=360 run async1p /tmp/src23 python3 async_bench.py --data $D --updates 20 --modes 1p $C --out $O/async1p
T=300 run async0 /tmp/src23 python3 async_bench.py --data $D --updates 20 --modes 0 $C --out $O/async0
T=240 run trl /tmp/site:/tmp/src23 python3 trl_grpo.py --model /tmp/mgcache/models/smollm2-135m-instruct-float32 --data $D --steps 5 --out $O/trl_grpo.json
echo done $(date) >> $O/driver.log; touch $O/done
