#!/bin/bash
# one H200 hold (~29 min): the calculator chain for seed $SEED as shipped (lookahead 0: the shipped loop); then, on the
# chain's own warm start, tools_bench's 4-draw pass (one batch, 2 repeats): tools off and on with MLX's CUDA graph
# limits as shipped and raised (a graph per ~step, not per layer: MLX_MAX_MB_PER_BUFFER counts the whole KV cache as
# each layer's attention input), the loop's lookahead with them, the standard step with each, the parts timed on the host
SEED=${SEED:-1234}
mkdir -p /tmp/r/chain /tmp/r/bench; date +%s > /tmp/r/t0
export PYTHONPATH=/tmp/mlxsite:$PWD/src PYTHONUNBUFFERED=1 MLX_GRPO_CACHE=/tmp/mgc0
cd /tmp/clean; B=/tmp/r/bench; D=/tmp/clean/.gsm8k
git rev-parse HEAD > /tmp/r/chain/preset.txt 2>/dev/null; git status --short >> /tmp/r/chain/preset.txt 2>/dev/null
grep -n "^draws_per_pass\|^running_rows\|^carry_surplus\|^rollout_correction\|^dynamic_sampling" configs/prod_tools.toml >> /tmp/r/chain/preset.txt
t() { echo "$1 $(( $(date +%s) - $(cat /tmp/r/t0) ))" >> $B/seconds.txt; }
BASE=0 bash bench/learning_run.sh /tmp/r/chain .gsm8k gsm8k_tools:$SEED; t chain
python3 .gpujobs/slim.py /tmp/r/chain/*-sft.jsonl /tmp/r/chain/*-trained.jsonl; t slim
W=$(ls -d /tmp/r/chain/runs/gsm8k_tools-s$SEED/gsm8k_tools_sft/checkpoint-* | sort -t- -k2 -n | tail -1); echo "$W" >> $B/seconds.txt
A="--plain configs/prod.toml --tools configs/prod_tools.toml --set model_name=$W --set dataset_path=$D/train.jsonl --batches 1 --repeats 2 --modes copy --draws 4 --set running_rows=1024"
RAISED="MLX_MAX_MB_PER_BUFFER=1000000 MLX_MAX_OPS_PER_BUFFER=1000"
# b NAME SECONDS "VAR=VALUE ..." ARGS...: one tools_bench run under those environment variables
b() { n=$1; s=$2; v=$3; shift 3; timeout $s env $v python3 bench/tools_bench.py $A "$@" --out $B/$n.json > $B/$n.log 2>&1; t $n; }
# the GPU's utilization through all of what follows (1 s samples, wall-clock times; seconds.txt's offsets count from t0)
nvidia-smi dmon -s u -d 1 -o T > $B/dmon.txt 2>&1 & M=$!
b base 100 "" --presets prompt,tools
b raised 100 "$RAISED" --presets prompt,tools
b raised-ahead4 70 "$RAISED" --lookahead 4 --presets tools
# the standard step (grpo_bench 16x16) with MLX's graph limits as shipped and raised
S="--data $D/train.jsonl --sections step --sizes 16x16 --repeats 3 --warmup 1"
timeout 90 python3 bench/grpo_bench.py $S --out $B/step-base > $B/step-base.log 2>&1; t step-base
timeout 90 env $RAISED python3 bench/grpo_bench.py $S --out $B/step-raised > $B/step-raised.log 2>&1; t step-raised
b raised-unsynced 80 "$RAISED" --phases --unsynced --presets tools
b ahead4 70 "" --lookahead 4 --presets tools
kill $M; touch /tmp/r/done
