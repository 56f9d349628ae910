# session 34, after the same-host Unix socket (80ffff2): depth sweep, the same at depth 4 over
# TCP only, every Done-when figure, one paired P/D run
cd /work/main
export LD_LIBRARY_PATH=/tmp/mcdeb/root/lib/x86_64-linux-gnu:/tmp/mcdeb/root/usr/lib/x86_64-linux-gnu
export PATH=/tmp/mcvenv/bin:$PATH
O=/tmp/s34/f2
MC="--mooncake-path /tmp/mcvenv/lib/python3.11/site-packages"
echo "sweep start $(date -u +%H:%M:%S)" > $O/times.txt
.venv/bin/pymooncake bench store --metadata-only --metadata-ops 20000 --metadata-clients 1 --metadata-clients 2 \
   --metadata-clients 4 --repeat 5 $MC --json > $O/sweep/sweep.json 2> $O/sweep/sweep.err
echo "tcp-only start $(date -u +%H:%M:%S)" >> $O/times.txt
PYMOONCAKE_RPC_UNIX=0 .venv/bin/pymooncake bench store --metadata-only --metadata-ops 20000 --metadata-clients 4 \
   --repeat 5 $MC --json > $O/sweep/sweep_tcp4.json 2> $O/sweep/sweep_tcp4.err
echo "peer start $(date -u +%H:%M:%S)" >> $O/times.txt
OUT=$O/peer COUNT=1024 bash docs/data/issue16_s24/peer.sh
python3 docs/data/issue16_s29/verdicts.py $O/peer > $O/peer/verdicts.txt 2>&1
echo "paired start $(date -u +%H:%M:%S)" >> $O/times.txt
.venv/bin/python -m pymooncake bench serving --configs global-cache,colocated-cache --paired 10 --json \
   > $O/paired/run1.json 2> $O/paired/run1.err
echo "end $(date -u +%H:%M:%S)" >> $O/times.txt
echo all-done
