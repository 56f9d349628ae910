#!/bin/bash
/tmp/s22/pairs.sh /tmp/s22/rec rec3 1
for i in 1 2 3; do
  /tmp/s22/pairs.sh /work/main fin$i 1
  /tmp/s22/pairs.sh /tmp/s22/basewt fb$i 1
done
