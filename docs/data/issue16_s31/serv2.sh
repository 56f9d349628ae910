#!/bin/bash
cd /work/main
for i in 4 5 6 7; do
  if [ $((i % 2)) -eq 0 ]; then c=colocated-cache,global-cache; else c=global-cache,colocated-cache; fi
  .venv/bin/python -m pymooncake bench serving --configs $c --json > /tmp/s31/serving/run_$i.json 2>/tmp/s31/serving/run_$i.err
  echo "serving $i ($c) $(date -u +%H:%M:%S)" >> /tmp/s31/peer/times.txt
done
