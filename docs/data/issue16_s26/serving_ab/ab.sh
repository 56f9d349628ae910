#!/bin/bash
# ab.sh FROM TO : alternating (old, new) bench-serving pairs (global-cache,colocated-cache)
mkdir -p /tmp/s26/ab
for i in $(seq $1 $2); do
  for t in old new; do
    PYTHONPATH=/tmp/s26/$t/src /work/main/.venv/bin/python -m pymooncake.cli.main bench serving --configs global-cache,colocated-cache --json > /tmp/s26/ab/${t}_$i.json 2>/tmp/s26/ab/${t}_$i.err
  done
done
echo done > /tmp/s26/ab/done_$2
