#!/bin/bash
# Session 31 scratch script: the trees A (HEAD) and B (the change) are copies of src under /tmp/s31.
cd /work/main
for r in $(seq 1 $1); do
  for t in A B; do
    [ $((r % 2)) -eq 0 ] && t=$([ $t = A ] && echo B || echo A)
    echo "$t $(PYTHONPATH=/tmp/s31/$t/src .venv/bin/python /tmp/s31/meta_ours.py 2 2>/dev/null | tr '\n' ' ')"
  done
done
