#!/bin/bash
# Wait up to $1 s for the hold's done file, print its logs, and pack everything into one file in $OUT.
end=$(( $(date +%s) + ${1:-0} )); O=${2:-/tmp/S23}
while [ ! -f $O/done ] && [ $(date +%s) -lt $end ]; do sleep 10; done
cat $O/driver.log
for f in $O/*.log; do echo "== $f"; grep -v "^\s*$" $f | grep -iv "warning" | tail -25 | cut -c1-400; done
tar czf $OUT/s23.tgz --exclude="*.safetensors" -C $O . 2>/dev/null; true
