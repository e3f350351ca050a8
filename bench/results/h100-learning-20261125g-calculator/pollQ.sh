#!/bin/bash
# wait until done or $1 seconds, then report
end=$(( $(date +%s) + ${1:-0} ))
cd /tmp/Q || exit 1
while [ ! -f done ] && [ $(date +%s) -lt $end ]; do sleep 10; done
cat driver.log control.driver.log tools.driver.log 2>/dev/null | tail -5
for f in */*.seconds; do echo "Q $f $(cat $f)"; done
for f in */*.log; do echo "== Q $f"; tail -n 2 $f | cut -c1-250; done
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
tar czf $OUT/Q.tgz --exclude='*.safetensors' --exclude='checkpoint-*' . 2>/dev/null; ls -la $OUT; true
