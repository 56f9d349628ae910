#!/bin/bash
# ab.sh N : N alternating (old, new) bench-serving pairs (global-cache,colocated-cache)
for i in $(seq $2 $1); do
  for t in old new; do
    PYTHONPATH=/tmp/s24/$t/src /work/main/.venv/bin/python /tmp/s24/faults.py global-cache,colocated-cache > /tmp/s24/ab_${t}_$i.json 2>/tmp/s24/ab_${t}_$i.err
  done
done
