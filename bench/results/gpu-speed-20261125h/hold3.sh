#!/bin/bash
# Session 20 hold 3 (background): TRL, then the new step and the step as shipped before, same sitting as hold 2
# Needs what hold2.sh needs, and hold2.sh run first in the same hold: TRL reads the float32 model that grpo_bench converts.
export PYTHONUNBUFFERED=1 MLX_GRPO_CACHE=/tmp/mgcache
R=$PWD; D=${DATA:-$R/.explore/gsm8k/train.jsonl}; O=$1; mkdir -p $O
V="python3 $R/bench/results/gpu-speed-20261125h/variant.py"; A="--data $D --sections step --repeats 3"
run() { n=$1; S=$2; shift 2; s0=$(date +%s); PYTHONPATH=/tmp/mlxsite:$S timeout ${T:-300} "$@" > $O/$n.log 2>&1; echo "$n rc=$? $(( $(date +%s) - s0 ))s" >> $O/driver.log; }
echo start $(date) > $O/driver.log
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $R/.gpuwheels/extra/*.whl >> $O/driver.log 2>&1 && echo extra-installed >> $O/driver.log
T=400 run trl /tmp/site:$R/src python3 $R/bench/trl_grpo.py --model /tmp/mgcache/models/smollm2-135m-instruct-float32 --data $D --steps 5 --out $O/trl_grpo.json
run step_new3 $R/src python3 bench/grpo_bench.py $A --out $O/step_new3
run step_old3 $R/src $V old mlx bench/grpo_bench.py $A --out $O/step_old3
echo done $(date) >> $O/driver.log; touch $O/done
