#!/bin/bash
# clean clone of /work/main: make demo, then CI=true .ci/run; results in /tmp/s27/ci_result.txt
D=$(mktemp -d)
ln -s /work/shared $D/shared
git clone -q /work/main $D/main
cd $D/main
t0=$(date +%s)
timeout 600 make demo > /tmp/s27/ci_demo.log 2>&1; rc1=$?
t1=$(date +%s)
CI=true timeout 1500 bash .ci/run > /tmp/s27/ci_run.log 2>&1; rc2=$?
t2=$(date +%s)
echo "demo rc $rc1 in $((t1-t0)) s; CI rc $rc2 in $((t2-t1)) s; dir $D" > /tmp/s27/ci_result.txt
tail -3 /tmp/s27/ci_run.log >> /tmp/s27/ci_result.txt
