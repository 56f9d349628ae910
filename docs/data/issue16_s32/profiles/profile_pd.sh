#!/bin/bash
# profile_pd.sh MODE: one `bench serving --configs global-cache` replay with a profiler on
# the decode worker and prefill-0. MODE: spy (py-spy, wall), gil (py-spy --gil), perf
# (perf record -g). Output in /tmp/s32/prof/$MODE.
cd /work/main
MODE=${1:-spy}
O=/tmp/s32/prof/$MODE; mkdir -p $O
.venv/bin/python -m pymooncake bench serving --configs global-cache --json > $O/bench.json 2> $O/bench.err &
B=$!
for i in $(seq 1 120); do
  D=$(pgrep -f "pymooncake decode --id decode-0" | head -1)
  [ -n "$D" ] && break; sleep 1
done
sleep 5
P=$(pgrep -f "pymooncake prefill --id prefill-0" | head -1)
echo "decode $D prefill $P" > $O/pids
for who in decode:$D prefill:$P; do
  name=${who%%:*}; pid=${who##*:}
  case $MODE in
    spy) .venv/bin/py-spy record -r 200 --nonblocking -f raw -d 110 -p $pid -o $O/$name.txt > /dev/null 2>&1 & ;;
    gil) .venv/bin/py-spy record -r 200 --gil --nonblocking -f raw -d 110 -p $pid -o $O/$name.txt > /dev/null 2>&1 & ;;
    perf) perf record -F 999 -g -p $pid -o $O/$name.perf -- sleep 100 > /dev/null 2>&1 & ;;
  esac
done
wait $B
echo done
