#!/bin/bash
# ab2.sh N : N alternating (both off, both on) bench-serving pairs from /tmp/s23/tree2
for i in $(seq 1 $1); do
  for mode in 0 1; do
    PYMOONCAKE_MALLOC_TUNING=$mode PYMOONCAKE_ONEDNN_ROW_BUCKETS=$mode PYTHONPATH=/tmp/s23/tree2/src /work/main/.venv/bin/python -m pymooncake bench serving --configs global-cache,colocated-cache --json > /tmp/s23/ab2_${mode}_$i.json 2>/tmp/s23/ab2_${mode}_$i.err
  done
done
