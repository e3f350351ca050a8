#!/bin/bash
# Same sitting: the packed_chunks change against HEAD's src (options on), chunking + step.
export PYTHONUNBUFFERED=1 MLX_GRPO_CACHE=/tmp/mgcache
D=$PWD/.explore/gsm8k/train.jsonl; O=$OUT/W; mkdir -p $O
ON="--set compile_update=true --set use_compile=true"
for v in new old new2; do
  case $v in old) S=$PWD/.explore/oldsrc/src ;; *) S=$PWD/src ;; esac
  PYTHONPATH=/tmp/mlxsite:$S timeout ${T:-240} python3 bench/grpo_bench.py --data $D --out $O/$v --sections chunking,step --chunkings 16x8192 --repeats 3 $ON > $O/$v.log 2>&1
  echo "== $v"; grep "^chunking\|grpo step\|full GRPO" $O/$v.log
done
