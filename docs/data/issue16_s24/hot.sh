#!/bin/bash
for i in $(seq 1 $1); do
  for mode in on off; do
    if [ $mode = off ]; then F="--no-hot-replication"; else F=""; fi
    PMK_EXTRA_CFLAGS="$F" PYTHONPATH=/tmp/s24/tree/src /work/main/.venv/bin/python /tmp/s24/faults.py global-cache > /tmp/s24/hot_${mode}_$i.json 2>/tmp/s24/hot_${mode}_$i.err
  done
done
