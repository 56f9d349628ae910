#!/bin/bash
# ab.sh N : N alternating (malloc tuning off, on) bench-serving pairs from /tmp/s23/tree
for i in $(seq 1 $1); do
  for mode in 0 1; do
    PYMOONCAKE_MALLOC_TUNING=$mode PYTHONPATH=/tmp/s23/tree/src /work/main/.venv/bin/python -m pymooncake bench serving --configs global-cache,colocated-cache --json > /tmp/s23/ab_${mode}_$i.json 2>/tmp/s23/ab_${mode}_$i.err
  done
done
