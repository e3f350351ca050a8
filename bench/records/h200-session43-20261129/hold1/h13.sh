#!/bin/bash
# one H200 hold (session 43, ~25 min): a short calculator warm start (300 updates) beside the gpu tier; then on that
# warm start tools_bench's 4-draw pass (1,024 rows, one batch, 2 repeats) at HEAD and at d965fb4 (before session 42's
# admissions and op cuts), lookahead 0/4/7, sync_every 12 with lookahead 8, CUDA graphs off; the standard step at HEAD
# and d965fb4 and TRL 1.16; the loop's parts on the host; the trainer for 2 minutes with lookahead 0 and 4.
# Parts run in order of need; each optional part is skipped once the hold's clock passes its limit.
mkdir -p /tmp/r/bench; date +%s > /tmp/r/t0; T0=$(cat /tmp/r/t0)
export PYTHONUNBUFFERED=1
cd /tmp/clean; B=/tmp/r/bench; D=/tmp/clean/.gsm8k
cp .gpujobs/head.txt $B/; cp .gpujobs/h13.sh $B/
mkdir -p /tmp/base && tar xzf .gpujobs/base.tgz -C /tmp/base
HEADP=/tmp/mlxsite:/tmp/clean/src; BASEP=/tmp/mlxsite:/tmp/base/src
t() { echo "$1 $(( $(date +%s) - T0 ))" >> $B/seconds.txt; }
before() { [ $(( $(date +%s) - T0 )) -lt "$1" ] || { echo "skipped $2 $(( $(date +%s) - T0 ))" >> $B/seconds.txt; false; }; }
# the warm start (its own kernel cache) beside the gpu tier (another)
( export PYTHONPATH=$HEADP MLX_GRPO_CACHE=/tmp/mgc0
  python3 -m mlx_grpo sft --config configs/gsm8k_tools_sft.toml --set dataset_path=$D/train.jsonl \
    --set eval_dataset_path=$D/test.jsonl --set max_train_samples=4800 --set num_epochs=1 --set eval_every_updates=0 \
    --set save_steps=0 --set output_dir=/tmp/ws > $B/warm.log 2>&1; t warm ) &
( export PYTHONPATH=$HEADP MLX_GRPO_CACHE=/tmp/mgc1
  timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_kernels.py tests/test_turn_cache.py \
    tests/test_forward.py > $B/gpu-tier.txt 2>&1; echo "rc $?" >> $B/gpu-tier.txt; t gpu-tier ) &
wait
export MLX_GRPO_CACHE=/tmp/mgc0
W=$(ls -d /tmp/ws/gsm8k_tools_sft/checkpoint-* | sort -t- -k2 -n | tail -1); echo "$W" >> $B/seconds.txt
A="--plain configs/prod.toml --tools configs/prod_tools.toml --set model_name=$W --set dataset_path=$D/train.jsonl --batches 1 --repeats 2 --modes copy --draws 4 --set running_rows=1024"
# b NAME SECONDS CODE "VAR=VALUE ..." ARGS...: one tools_bench run of that code (head / base) under those variables
b() { local n=$1 s=$2 c=$3 v=$4; shift 4; local p=$HEADP dir=/tmp/clean
  [ "$c" = base ] && p=$BASEP dir=/tmp/base
  (cd $dir && timeout $s env PYTHONPATH=$p $v python3 bench/tools_bench.py $A "$@" --out $B/$n.json > $B/$n.log 2>&1); t $n; }
S="--data $D/train.jsonl --sections step --sizes 16x16 --repeats 3 --warmup 1"
st() { (cd $2 && timeout 120 env PYTHONPATH=$3 python3 bench/grpo_bench.py $S --out $B/$1 > $B/$1.log 2>&1); t $1; }
nvidia-smi dmon -s u -d 1 -o T > $B/dmon.txt 2>&1 & M=$!
b head 110 head "" --presets prompt,tools
b ahead4 70 head "" --lookahead 4 --presets tools
st step-head /tmp/clean $HEADP
before 900 trl && { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /tmp/whl/*.whl
  timeout 150 env PYTHONPATH=/tmp/site python3 bench/trl_grpo.py --model $MLX_GRPO_CACHE/models/smollm2-135m-instruct-float32 \
    --data $D/train.jsonl --steps 5 --out $B/trl > $B/trl.log 2>&1; t trl; }
before 1000 base && b base 110 base "" --presets prompt,tools
before 1050 base-ahead4 && b base-ahead4 70 base "" --lookahead 4 --presets tools
before 1100 head-2 && b head-2 70 head "" --presets tools
before 1150 ahead4-2 && b ahead4-2 70 head "" --lookahead 4 --presets tools
before 1200 step-base && st step-base /tmp/base $BASEP
# the trainer, 2 minutes each from the same warm start: lookahead 0, then 4 (updates' seconds in the metrics), both or none
before 1100 train && for L in 0 4; do (export PYTHONPATH=$HEADP; timeout 210 python3 bench/tools_bench.py \
  --tools configs/prod_tools.toml --set model_name=$W --set dataset_path=$D/train.jsonl --set output_dir=/tmp/t$L \
  --set lookahead=$L --train-minutes 2 --unsynced --out $B/train$L.json > $B/train$L.log 2>&1; t train$L); done
before 1480 ahead7 && b ahead7 70 head "" --lookahead 7 --presets tools
before 1530 s12-ahead8 && b s12-ahead8 70 head "" --sync-every 12 --lookahead 8 --presets tools
before 1580 nographs-ahead4 && b nographs-ahead4 70 head "MLX_USE_CUDA_GRAPHS=0" --lookahead 4 --presets tools
before 1600 phases && b phases-ahead4 80 head "" --lookahead 4 --phases --unsynced --presets tools
kill $M; touch /tmp/r/done
