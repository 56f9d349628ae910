#!/bin/bash
# ab3.sh N : N alternating (both off, both on) bench-serving pairs from /tmp/s23/tree3, with
# per-process page faults (faults.py, stderr) and mallinfo2 logs (sitecustomize_probe, PMK_MI)
for i in $(seq 1 $1); do
  for mode in 0 1; do
    rm -f /tmp/s23/mi_*.log
    PMK_MI=1 PYMOONCAKE_MALLOC_TUNING=$mode PYMOONCAKE_ONEDNN_ROW_BUCKETS=$mode PYTHONPATH=/tmp/s23/tree3/src:/tmp/s23/sc /work/main/.venv/bin/python /tmp/s23/faults.py global-cache,colocated-cache > /tmp/s23/ab3_${mode}_$i.json 2>/tmp/s23/ab3_${mode}_$i.err
    mkdir -p /tmp/s23/mi3_${mode}_$i; mv /tmp/s23/mi_*.log /tmp/s23/mi3_${mode}_$i/ 2>/dev/null
  done
done
