#!/bin/bash
cd /work/main
O=/tmp/s27/thr_$1; mkdir -p $O; rm -f $O/*
.venv/bin/python -m pymooncake bench serving --configs $1 --json > $O/bench.json 2> $O/bench.err &
B=$!
snap() { for p in $(pgrep -f "pymooncake (prefill|decode) --"); do for t in /proc/$p/task/*; do echo "$p ${t##*/} $(awk '{print $14+$15}' $t/stat)"; done; done; }
sleep 20; snap > $O/t0.txt
for p in $(pgrep -f "pymooncake (prefill|decode) --"); do .venv/bin/py-spy dump --nonblocking -p $p > $O/dump_$p.txt 2>&1; done
while kill -0 $B 2>/dev/null; do snap > $O/t1.tmp && mv $O/t1.tmp $O/t1.txt; sleep 2; done
echo done
