#!/bin/bash
# 3 back-to-back `bench serving` pairs (P/D global-cache and colocated-cache)
mkdir -p /tmp/s28/serving2
for i in 1 2 3; do
  /work/main/.venv/bin/python -m pymooncake bench serving --configs global-cache,colocated-cache --json > /tmp/s28/serving2/run_$i.json 2>/tmp/s28/serving2/run_$i.err
done
echo done > /tmp/s28/serving2/done
