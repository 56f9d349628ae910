#!/bin/bash
cd /work/main
export LD_LIBRARY_PATH=/tmp/mcdeb/root/lib/x86_64-linux-gnu:/tmp/mcdeb/root/usr/lib/x86_64-linux-gnu
export PATH=/tmp/mcvenv/bin:$PATH
O=/tmp/s42/rerun; mkdir -p $O
echo "start $(date -u +%H:%M:%S) $(git rev-parse --short HEAD)" > $O/times.txt
.venv/bin/pymooncake bench store --size 64K --size 1M --size 16M --count 1024 --repeat 7 --metadata-ops 20000 \
    --metadata-clients 4 --mooncake-path /tmp/mcvenv/lib/python3.11/site-packages --json > $O/store.json 2> $O/store.err
echo "store $(date -u +%H:%M:%S)" >> $O/times.txt
.venv/bin/python -m pymooncake bench serving --configs global-cache,colocated-cache --paired 10 --json > $O/paired.json 2> $O/paired.err
echo "end $(date -u +%H:%M:%S)" >> $O/times.txt
