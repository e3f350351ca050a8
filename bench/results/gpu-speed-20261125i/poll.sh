#!/bin/bash
end=$(( $(date +%s) + ${1:-0} )); O=${2:-/tmp/S21c}
while [ ! -f $O/done ] && [ $(date +%s) -lt $end ]; do sleep 10; done
cat $O/driver.log
for f in $O/*.log; do echo "== $f"; grep -i "step [0-9]\|s/step\|mean\|grpo step\|tok/s\|s/step\|^| \(engine\|model\|plain\)\|error\|Traceback" $f | tail -10 | cut -c1-300; done
mkdir -p $OUT/s21c; cp $O/*.log $OUT/s21c/ 2>/dev/null
for f in $(find $O -name "*.json"); do cp $f $OUT/s21c/$(echo ${f#$O/} | tr / _); done; true
