cd /work/main
export PYTHONPATH=/work/main/docs/data/issue16_s29 PMK_THREADS=1
PACE=0.08 .venv/bin/python /tmp/s33/thr_replay.py global-cache > /tmp/s33/thr_pd80.json 2>/tmp/s33/thr_pd80.err
.venv/bin/python /tmp/s33/thr_replay.py colocated-cache > /tmp/s33/thr_col.json 2>/tmp/s33/thr_col.err
.venv/bin/python /tmp/s33/thr_replay.py global-cache > /tmp/s33/thr_pd0.json 2>/tmp/s33/thr_pd0.err
echo done
