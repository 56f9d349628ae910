#!/bin/bash
# ab.sh FROM TO : alternating (old, new) bench-serving pairs (global-cache,colocated-cache)
for i in $(seq $1 $2); do
  for t in old new; do
    PYTHONPATH=/tmp/s25/$t/src /work/main/.venv/bin/python /tmp/s24/faults.py global-cache,colocated-cache > /tmp/s25/ab_${t}_$i.json 2>/tmp/s25/ab_${t}_$i.err
  done
done
echo done > /tmp/s25/ab_done_$2
