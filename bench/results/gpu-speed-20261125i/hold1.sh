#!/bin/bash
# Session 21 hold 1 (background): full steps at the defaults and with the compiled training step,
# async_rollouts 1 against 0 (20 updates each, compiled step), TRL, and the two step settings again.
# Needs MLX and the default model under /tmp/mlxsite and TRL's wheels in .gpuwheels/extra (device notes).
export PYTHONUNBUFFERED=1 MLX_GRPO_CACHE=/tmp/mgcache
R=$PWD; O=$1; mkdir -p $O /tmp/gsm8k
# the data outside the checkout: a later device call that carries no .explore removes it there
D=${DATA:-/tmp/gsm8k/train.jsonl}; [ -f $D ] || cp $R/.explore/gsm8k/train.jsonl $D
A="--data $D --sections step --repeats 3 --warmup 2"; C="--set compile_update=true --set use_compile=true"
run() { n=$1; S=$2; shift 2; s0=$(date +%s); PYTHONPATH=/tmp/mlxsite:$S timeout ${T:-300} "$@" > $O/$n.log 2>&1; echo "$n rc=$? $(( $(date +%s) - s0 ))s" >> $O/driver.log; }
echo start $(date) > $O/driver.log
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $R/.gpuwheels/extra/*.whl >> $O/driver.log 2>&1 && echo extra-installed >> $O/driver.log
run step_def $R/src python3 bench/grpo_bench.py $A --out $O/step_def
run step_opt $R/src python3 bench/grpo_bench.py $A $C --out $O/step_opt
T=420 run async $R/src python3 bench/async_bench.py --data $D --updates 20 --modes 1,0 $C --out $O/async
T=400 run trl /tmp/site:$R/src python3 $R/bench/trl_grpo.py --model /tmp/mgcache/models/smollm2-135m-instruct-float32 --data $D --steps 5 --out $O/trl_grpo.json
run step_def2 $R/src python3 bench/grpo_bench.py $A --out $O/step_def2
run step_opt2 $R/src python3 bench/grpo_bench.py $A $C --out $O/step_opt2
echo done $(date) >> $O/driver.log; touch $O/done
