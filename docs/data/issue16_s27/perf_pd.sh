#!/bin/bash
# P/D replay with py-spy on the decode worker and one prefill worker
cd /work/main
O=/tmp/s27/perf; mkdir -p $O
.venv/bin/python -m pymooncake bench serving --configs global-cache --json > $O/bench.json 2> $O/bench.err &
B=$!
for i in $(seq 1 120); do
  D=$(pgrep -f "pymooncake decode --id decode-0" | head -1)
  [ -n "$D" ] && break; sleep 1
done
sleep 5
P=$(pgrep -f "pymooncake prefill --id prefill-0" | head -1)
echo "decode $D prefill $P" > $O/pids
perf record -F 999 -g -p $D -o $O/decode.perf -- sleep 100 > /dev/null 2>&1 &
perf record -F 999 -g -p $P -o $O/prefill.perf -- sleep 100 > /dev/null 2>&1 &
wait $B
echo done
