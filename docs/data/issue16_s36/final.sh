#!/bin/bash
# Issue 16, session 36: every Done-when figure in one run: session 35's final.sh (same
# flags as session 24's peer.sh, plus `bench transfer --transport cma`, the depth sweep of
# the metadata ops, one paired `bench serving`), then a second paired serving run.
# OUT=DIR (default /tmp/s36/final).
cd /work/main
O=${OUT:-/tmp/s36/final}
OUT=$O bash docs/data/issue16_s35/final.sh | grep -v all-done
.venv/bin/python -m pymooncake bench serving --configs global-cache,colocated-cache --paired 10 --json \
   > $O/paired2.json 2> $O/paired2.err
echo "paired2 end $(date -u +%H:%M:%S)" >> $O/times.txt
echo all-done
