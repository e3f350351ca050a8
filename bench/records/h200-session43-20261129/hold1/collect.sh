#!/bin/bash
# a poll: wait until the hold script has ended (/tmp/r/done) or $1 seconds have passed, then send back all it wrote
end=$(( $(date +%s) + $1 ))
while [ ! -f /tmp/r/done ] && [ "$(date +%s)" -lt $end ]; do sleep 5; done
echo "== seconds since t0: $(( $(date +%s) - $(cat /tmp/r/t0 2>/dev/null || date +%s) ))"
cat /tmp/r/bench/seconds.txt 2>/dev/null
echo "== h13.log"; tail -c 3000 /tmp/h13.log 2>/dev/null
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
tar czf "$OUT/r.tgz" -C /tmp r 2>/dev/null; ls -la "$OUT"
