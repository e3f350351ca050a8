#!/bin/bash
# Wait up to $1 s for the hold's done file, print its logs' key lines, and pack everything into one file in $OUT.
end=$(( $(date +%s) + ${1:-0} )); O=${2:-/tmp/S22}
while [ ! -f $O/done ] && [ $(date +%s) -lt $end ]; do sleep 10; done
cat $O/driver.log
for f in $O/*.log; do echo "== $f"; grep -i "grpo step [0-9]\|s/step\|updates/min\|^| [01]\|vs 0\|error\|Traceback" $f | tail -12 | cut -c1-300; done
tar czf $OUT/s22.tgz --exclude="*.safetensors" -C $O . 2>/dev/null; true
