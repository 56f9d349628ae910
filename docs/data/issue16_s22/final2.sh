#!/bin/bash
for i in 4 5 6; do
  /tmp/s22/pairs.sh /tmp/s22/basewt fb$i 1
  /tmp/s22/pairs.sh /work/main fin$i 1
done
