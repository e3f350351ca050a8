#!/bin/bash
# wait until done or $1 seconds, then report
end=$(( $(date +%s) + ${1:-0} ))
cd /tmp/P || exit 1
while [ ! -f done ] && [ $(date +%s) -lt $end ]; do sleep 10; done
tail -3 driver.log
for f in *.seconds; do echo "P $f $(cat $f)"; done
for f in *.log; do echo "== P $f"; tail -n 2 $f | cut -c1-300; done
for r in runs*/*/; do echo "== P $r"; [ -f $r/eval.jsonl ] && cut -c1-220 $r/eval.jsonl | tail -3; [ -f $r/metrics.jsonl ] && tail -n1 $r/metrics.jsonl | python3 -c "
import sys,json
d=json.loads(sys.stdin.read()); print({k:d.get(k) for k in ('update_step','reward/reasoned_correctness','zero_std_fraction','draws','time_step_s','peak_memory_gb','tool_call_rate','learning_rate')})"; done
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
tar czf $OUT/P.tgz *.log *.seconds *.jsonl runs*/*/*.jsonl runs*/*/*.png 2>/dev/null; ls -la $OUT; true
