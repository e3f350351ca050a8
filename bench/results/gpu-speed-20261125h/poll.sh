#!/bin/bash
end=$(( $(date +%s) + ${1:-0} )); O=${2:-/tmp/S20}
while [ ! -f $O/done ] && [ $(date +%s) -lt $end ]; do sleep 10; done
cat $O/driver.log
for f in $O/*.log; do echo "== $f"; grep -i "step [0-9]\|s/step\|mean\|grpo step\|tok/s\|s/step\|^| \(engine\|model\|plain\)\|error\|Traceback" $f | tail -10 | cut -c1-300; done
mkdir -p $OUT/s20; cp $O/*.log $OUT/s20/ 2>/dev/null
for f in $(find $O -name "*.json"); do cp $f $OUT/s20/$(echo ${f#$O/} | tr / _); done; true
