#!/bin/bash
cd /work/main
export LD_LIBRARY_PATH=/tmp/mcdeb/root/lib/x86_64-linux-gnu:/tmp/mcdeb/root/usr/lib/x86_64-linux-gnu
P=.venv/bin/pymooncake
O=${OUT:-/tmp/s24/peer}  # session 25: OUT=/tmp/s25/peer COUNT=1024
export PATH=/tmp/mcvenv/bin:$PATH  # mooncake_master for the metadata bench
echo "start $(date -u +%H:%M:%S)" > $O/times.txt
$P bench store --size 64K --size 1M --size 16M --count ${COUNT:-128} --repeat 7 --metadata-ops 20000 \
    --metadata-clients 4 --mooncake-path /tmp/mcvenv/lib/python3.11/site-packages --json > $O/store.json 2> $O/store.err
echo "store $(date -u +%H:%M:%S)" >> $O/times.txt
M="--mooncake-python /tmp/mcvenv/bin/python"
$P bench transfer --transport tcp --size 4096     --batch 128 --paths 2 --repeat 9 --min-time-s 0.5 $M --json > $O/tcp4k.json 2> $O/tcp4k.err
$P bench transfer --transport tcp --size 16777216 --batch 2   --paths 2 --repeat 9 --min-time-s 0.5 $M --json > $O/tcp16m.json 2> $O/tcp16m.err
$P bench transfer --transport shm --size 4194304  --batch 8   --paths 2 --repeat 9 --min-time-s 0.5 $M --json > $O/shm4m.json 2> $O/shm4m.err
echo "transfer $(date -u +%H:%M:%S)" >> $O/times.txt
$P bench store-load --repeats 3 --transports tcp --suffix-tokens 512 --json > $O/load.json 2> $O/load.err
echo "load $(date -u +%H:%M:%S)" >> $O/times.txt
TBT_ROUNDS=8 .venv/bin/python -m pytest -s -p no:xdist -p no:cacheprovider tests/store/test_kv_loader_async.py -k tbt > $O/tbt.txt 2>&1
echo "tbt $(date -u +%H:%M:%S)" >> $O/times.txt
