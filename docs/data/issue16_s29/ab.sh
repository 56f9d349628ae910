#!/bin/bash
# ab.sh ROUNDS OUT [T1 T2 [OPS]]: alternated rounds of session 28's ph3.py (4 clients,
# 12,000 calls a phase) from the src trees /tmp/s29/T1/src and /tmp/s29/T2/src
# (`git archive REV src | tar -x -C /tmp/s29/T`); defaults A B is_exist,get_size,remove.
# ab_meta.txt: `ab.sh 4` then `ab.sh 6` with A = 0f0cde0, B = 66eef19;
# ab_bc.txt: `ab.sh 8 ab_bc.txt B C is_exist,remove` with C = B plus 0f0cde0's
# store/tiers/dram_segment.py and store/master/core.py.
out=$2; t1=${3:-A}; t2=${4:-B}; ops=${5:-is_exist,get_size,remove}; : > $out
for r in $(seq 1 $1); do
  if [ $((r % 2)) = 1 ]; then order="$t1 $t2"; else order="$t2 $t1"; fi
  for t in $order; do
    echo "$t $(cd /tmp && PYTHONPATH=/tmp/s29/$t/src N=12000 /work/main/.venv/bin/python /work/main/docs/data/issue16_s28/ph3.py $ops 2>&1 | grep ops/s | awk '{print $1, $2}' | tr '\n' ' ')" >> $out
  done
done
