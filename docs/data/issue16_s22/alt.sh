#!/bin/bash
# alt.sh N : N rounds of (new pair, base pair)
for i in $(seq $2 $1); do
  /tmp/s22/pairs.sh /work/main chunk$i 1; mv /tmp/s22/serv_chunk${i}_1.json /tmp/s22/serv_chunk_$i.json
  /tmp/s22/pairs.sh /tmp/s22/basewt base$i 1; mv /tmp/s22/serv_base${i}_1.json /tmp/s22/serv_b_$i.json
done
