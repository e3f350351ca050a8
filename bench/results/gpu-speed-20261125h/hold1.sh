#!/bin/bash
# Session 20 hold 1: checks and standalone timings (attncheck.py), decode_profile per variant (interleaved)
export PYTHONPATH=/tmp/mlxsite:$PWD/src PYTHONUNBUFFERED=1 MLX_GRPO_CACHE=/tmp/mgcache
O=$1; mkdir -p $O; V="python3 bench/results/gpu-speed-20261125h/variant.py"
timeout 200 python3 bench/results/gpu-speed-20261125h/attncheck.py 2>&1 | tee $O/check.log | tail -40
for round in 1 2; do
 for a in old new; do
  for s in mlx keyed; do
   [ $round = 2 ] && [ $s != $( [ $a = old ] && echo mlx || echo keyed ) ] && continue
   timeout 120 $V $a $s bench/decode_profile.py --builders engine --rows 64,256,1024 --steps 24 --out $O/dp_${a}_${s}_$round.json 2>&1 | grep -v "^|" | tail -3 > $O/dp_${a}_${s}_$round.log
   python3 -c "
import json,sys;d=json.load(open('$O/dp_${a}_${s}_$round.json'))
for r in d['rows']: print('$a $s $round', r['rows'], 'steady', round(r['steady_ms'],2), 'dispatch', round(r['dispatch_ms'],2), 'wait', round(r['wait_ms'],2), 'nodes', r['primitives'])"
  done
 done
done
