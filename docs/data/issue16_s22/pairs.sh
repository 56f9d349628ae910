#!/bin/bash
# pairs.sh TREE TAG N : N replay pairs (P/D, colocated) with TREE's source
TREE=$1; TAG=$2; N=$3
for i in $(seq 1 $N); do
  PYTHONPATH=$TREE/src /work/main/.venv/bin/python -m pymooncake bench serving --configs global-cache,colocated-cache --json > /tmp/s22/serv_${TAG}_$i.json 2>/tmp/s22/serv_${TAG}_$i.err
done
