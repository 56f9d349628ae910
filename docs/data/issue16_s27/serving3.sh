#!/bin/bash
mkdir -p /tmp/s27/serving
for i in 1 2 3; do
  /work/main/.venv/bin/python -m pymooncake bench serving --configs global-cache,colocated-cache --json > /tmp/s27/serving/run_$i.json 2>/tmp/s27/serving/run_$i.err
done
echo done > /tmp/s27/serving/done
