#!/bin/bash
# idle_thr.sh CONFIG: per-thread CPU of every cluster process over 30 s of idling
cd /work/main; rm -rf /tmp/s29/thr/*; 
(PMK_THREADS=1 PYTHONPATH=/tmp/s29/sc .venv/bin/python docs/data/issue16_s27/idle.py $1 40 > /tmp/s29/idle_thr_$1.txt 2>&1 &)
sleep 16; rm -rf /tmp/s29/ta; cp -r /tmp/s29/thr /tmp/s29/ta; sleep 30; rm -rf /tmp/s29/tb; cp -r /tmp/s29/thr /tmp/s29/tb; sleep 15
python3 - <<'PY'
import json,glob
for f in sorted(glob.glob('/tmp/s29/tb/*.json')):
    b=json.load(open(f)); a=json.load(open(f.replace('/tb/','/ta/')))
    d={k.split(':',1)[1]: round(v-a.get(k,0),3) for k,v in b.items() if v-a.get(k,0)>0}
    print(f.split('/')[-1][:-5], round(sum(d.values()),2), d)
PY
