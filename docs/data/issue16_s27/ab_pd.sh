#!/bin/bash
# ab_pd.sh FROM TO : alternating (old, new) bench-serving runs of the P/D config only
for i in $(seq $1 $2); do
  for t in old new; do
    PYTHONPATH=/tmp/s27/$t/src /work/main/.venv/bin/python -m pymooncake.cli.main bench serving --configs global-cache --json > /tmp/s27/ab/${t}_$i.json 2>/tmp/s27/ab/${t}_$i.err
  done
done
echo done > /tmp/s27/ab/done_$2
