#!/bin/bash
# Issue 16, session 36: every Done-when figure in one run (session 35's final.sh, plus a second paired serving run)
# Same flags as session 24's peer.sh, plus `bench transfer --transport cma`, the depth sweep of
# the metadata ops and two paired `bench serving` runs. OUT=DIR (default /tmp/s36/final).
cd /work/main
export LD_LIBRARY_PATH=/tmp/mcdeb/root/lib/x86_64-linux-gnu:/tmp/mcdeb/root/usr/lib/x86_64-linux-gnu
export PATH=/tmp/mcvenv/bin:$PATH  # mooncake_master for the metadata bench
P=.venv/bin/pymooncake
O=${OUT:-/tmp/s36/final}
mkdir -p $O
MC="--mooncake-path /tmp/mcvenv/lib/python3.11/site-packages"
M="--mooncake-python /tmp/mcvenv/bin/python"
echo "start $(date -u +%H:%M:%S) $(git rev-parse --short HEAD)" > $O/times.txt
$P bench store --size 64K --size 1M --size 16M --count ${COUNT:-1024} --repeat 7 --metadata-ops 20000 \
    --metadata-clients 4 $MC --json > $O/store.json 2> $O/store.err
echo "store $(date -u +%H:%M:%S)" >> $O/times.txt
$P bench transfer --transport tcp --size 4096     --batch 128 --paths 2 --repeat 9 --min-time-s 0.5 $M --json > $O/tcp4k.json 2> $O/tcp4k.err
$P bench transfer --transport tcp --size 16777216 --batch 2   --paths 2 --repeat 9 --min-time-s 0.5 $M --json > $O/tcp16m.json 2> $O/tcp16m.err
$P bench transfer --transport shm --size 4194304  --batch 8   --paths 2 --repeat 9 --min-time-s 0.5 $M --json > $O/shm4m.json 2> $O/shm4m.err
$P bench transfer --transport cma --size 4194304  --batch 8   --paths 2 --repeat 9 --min-time-s 0.5 $M --json > $O/cma4m.json 2> $O/cma4m.err
echo "transfer $(date -u +%H:%M:%S)" >> $O/times.txt
$P bench store-load --repeats 3 --transports tcp --suffix-tokens 512 --json > $O/load.json 2> $O/load.err
echo "load $(date -u +%H:%M:%S)" >> $O/times.txt
TBT_ROUNDS=8 .venv/bin/python -m pytest -s -p no:xdist -p no:cacheprovider tests/store/test_kv_loader_async.py -k tbt > $O/tbt.txt 2>&1
echo "tbt $(date -u +%H:%M:%S)" >> $O/times.txt
$P bench store --metadata-only --metadata-ops 20000 --metadata-clients 1 --metadata-clients 2 \
   --metadata-clients 4 --repeat 5 $MC --json > $O/sweep.json 2> $O/sweep.err
echo "sweep $(date -u +%H:%M:%S)" >> $O/times.txt
python3 docs/data/issue16_s35/verdicts.py $O > $O/verdicts.txt 2>&1
.venv/bin/python -m pymooncake bench serving --configs global-cache,colocated-cache --paired 10 --json \
   > $O/paired.json 2> $O/paired.err
echo "paired $(date -u +%H:%M:%S)" >> $O/times.txt
.venv/bin/python -m pymooncake bench serving --configs global-cache,colocated-cache --paired 10 --json \
   > $O/paired2.json 2> $O/paired2.err
echo "end $(date -u +%H:%M:%S)" >> $O/times.txt
echo all-done
