#!/bin/bash
cd /work/main
export LD_LIBRARY_PATH=/tmp/mcdeb/root/lib/x86_64-linux-gnu:/tmp/mcdeb/root/usr/lib/x86_64-linux-gnu
for i in 1 2; do
  for p in 0 5e-5; do
    PMK_POLL=$p PYTHONPATH=/tmp/s24/scp .venv/bin/pymooncake bench store --size 4K --count 1 --mode embedded --repeat 3 --metadata-ops 20000 --metadata-clients 4 --mooncake-path /tmp/mcvenv/lib/python3.11/site-packages --json > /tmp/s24/poll_${p}_$i.json 2>/dev/null
  done
done
