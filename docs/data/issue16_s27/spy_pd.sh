#!/bin/bash
# P/D replay with py-spy on the decode worker and one prefill worker
cd /work/main
O=/tmp/s27/spy; mkdir -p $O
.venv/bin/python -m pymooncake bench serving --configs global-cache --json > $O/bench.json 2> $O/bench.err &
B=$!
for i in $(seq 1 120); do
  D=$(pgrep -f "pymooncake decode --id decode-0" | head -1)
  [ -n "$D" ] && break; sleep 1
done
sleep 5
P=$(pgrep -f "pymooncake prefill --id prefill-0" | head -1)
echo "decode $D prefill $P" > $O/pids
.venv/bin/py-spy record -r 200 --nonblocking -f raw -d 110 -p $D -o $O/decode.txt > /dev/null 2>&1 &
.venv/bin/py-spy record -r 200 --nonblocking -f raw -d 110 -p $P -o $O/prefill.txt > /dev/null 2>&1 &
wait $B
echo done
