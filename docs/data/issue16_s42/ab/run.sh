#!/bin/bash
# Issue 16 session 42: bench store, embedded rows, three runs of the library before
# (d6f8312, from a git worktree at /tmp/s42/old put first on PYTHONPATH) and after (4fedffb,
# this checkout) the own-segment overlapped get, alternating old/new. Summary: sum.py.
cd /work/main
export LD_LIBRARY_PATH=/tmp/mcdeb/root/lib/x86_64-linux-gnu:/tmp/mcdeb/root/usr/lib/x86_64-linux-gnu
export PATH=/tmp/mcvenv/bin:$PATH
MC="--mooncake-path /tmp/mcvenv/lib/python3.11/site-packages"
for i in 1 2 3; do
  for v in old new; do
    if [ $v = old ]; then PP=/tmp/s42/old/src; else PP=; fi
    echo "$v $i start $(date -u +%H:%M:%S)" >> /tmp/s42/ab/times.txt
    PYTHONPATH=$PP .venv/bin/python -m pymooncake bench store --mode embedded --size 64K --size 1M --size 16M \
      --count 1024 --repeat 7 --metadata-ops 0 $MC --json > /tmp/s42/ab/${v}_$i.json 2> /tmp/s42/ab/${v}_$i.err
  done
done
echo "end $(date -u +%H:%M:%S)" >> /tmp/s42/ab/times.txt
