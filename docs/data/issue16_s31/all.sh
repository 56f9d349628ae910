#!/bin/bash
cd /work/main
OUT=/tmp/s31/peer COUNT=1024 bash docs/data/issue16_s24/peer.sh
echo "peer done $(date -u +%H:%M:%S)" >> /tmp/s31/peer/times.txt
for i in 1 2 3; do
  .venv/bin/python -m pymooncake bench serving --configs global-cache,colocated-cache --json > /tmp/s31/serving/run_$i.json 2>/tmp/s31/serving/run_$i.err
  echo "serving $i $(date -u +%H:%M:%S)" >> /tmp/s31/peer/times.txt
done
echo done > /tmp/s31/serving/done
