cd /work/main
export LD_LIBRARY_PATH=/tmp/mcdeb/root/lib/x86_64-linux-gnu:/tmp/mcdeb/root/usr/lib/x86_64-linux-gnu
export PATH=/tmp/mcvenv/bin:$PATH
echo "sweep start $(date -u +%H:%M:%S)" > /tmp/s34/sweep/times.txt
.venv/bin/pymooncake bench store --metadata-only --metadata-ops 20000 --metadata-clients 1 --metadata-clients 2 \
   --metadata-clients 4 --repeat 5 --mooncake-path /tmp/mcvenv/lib/python3.11/site-packages --json > /tmp/s34/sweep/sweep.json 2> /tmp/s34/sweep/sweep.err
echo "sweep end $(date -u +%H:%M:%S)" >> /tmp/s34/sweep/times.txt
OUT=/tmp/s34/peer COUNT=1024 bash docs/data/issue16_s24/peer.sh
python3 docs/data/issue16_s29/verdicts.py /tmp/s34/peer > /tmp/s34/peer/verdicts.txt 2>&1
echo all-done
