#!/bin/bash
# ab.sh ROUNDS OUT: alternated ph3 rounds of trees A and B (is_exist,remove; 4 clients)
out=$2; : > $out
for r in $(seq 1 $1); do
  if [ $((r % 2)) = 1 ]; then order="A B"; else order="B A"; fi
  for t in $order; do
    echo "$t $(cd /tmp && PYTHONPATH=/tmp/s29/$t/src N=12000 /work/main/.venv/bin/python /work/main/docs/data/issue16_s28/ph3.py is_exist,get_size,remove 2>&1 | grep ops/s | awk '{print $1, $2}' | tr '\n' ' ')" >> $out
  done
done
