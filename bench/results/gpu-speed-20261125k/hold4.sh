#!/bin/bash
# Session 23 hold 4 (background): the split fused attention kernel ("now") against the kernel before it
# ("before": before_decode_attention.py swapped into a copy of src/), one sitting with TRL:
# kernel checks + rollout against the plain loop, CUPTI traces, full steps, TRL, a step again.
# Needs MLX and the default model under /tmp/mlxsite, TRL's wheels in .gpuwheels/extra, GSM8K in /tmp/gsm8k.
export PYTHONUNBUFFERED=1 MLX_GRPO_CACHE=/tmp/mgcache
R=$PWD; O=$1; mkdir -p $O /tmp/gsm8k
D=/tmp/gsm8k/train.jsonl; [ -f $D ] || cp $R/.explore/gsm8k/train.jsonl $D
K=bench/results/gpu-speed-20261125k
rm -rf /tmp/src23 /tmp/srcB /tmp/bench23; cp -r $R/src /tmp/src23; cp -r $R/src /tmp/srcB; cp -r $R/bench /tmp/bench23
cp $R/$K/before_decode_attention.py /tmp/srcB/mlx_grpo/models/decode_attention.py
run() { n=$1; S=$2; shift 2; s0=$(date +%s)
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > $O/$n.smi 2>/dev/null & smi=$!
  PYTHONPATH=/tmp/mlxsite:$S:/tmp/bench23 timeout ${T:-300} "$@" > $O/$n.log 2>&1; rc=$?; kill $smi
  echo "$n rc=$rc $(( $(date +%s) - s0 ))s gpu-max-MiB=$(sort -n $O/$n.smi | tail -1)" >> $O/driver.log; }
echo start $(date) > $O/driver.log
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $R/.gpuwheels/extra/*.whl >> $O/driver.log 2>&1 && echo extra-installed >> $O/driver.log
cd /tmp/bench23
A="--data $D --sections step --repeats 3 --warmup 2"
T=300 run rollout_now /tmp/src23 python3 grpo_bench.py --data $D --sections rollout --sizes 16x16 --repeats 2 --out $O/rollout_now
mkdir -p $O/now $O/before
T=200 run busy_now /tmp/src23 python3 $K/busyprobe.py $D $O/now
T=200 run busy_before /tmp/srcB python3 $K/busyprobe.py $D $O/before
gzip -f $O/now/trace-engine.json; rm -f $O/now/*.json $O/before/*.json
T=300 run step_now /tmp/src23 python3 grpo_bench.py $A --out $O/step_now
T=300 run step_before /tmp/srcB python3 grpo_bench.py $A --out $O/step_before
T=300 run trl /tmp/site:/tmp/src23 python3 trl_grpo.py --model /tmp/mgcache/models/smollm2-135m-instruct-float32 --data $D --steps 5 --out $O/trl_grpo.json
T=240 run step_now2 /tmp/src23 python3 grpo_bench.py $A --out $O/step_now2
T=240 run step_before2 /tmp/srcB python3 grpo_bench.py $A --out $O/step_before2
echo done $(date) >> $O/driver.log; touch $O/done
