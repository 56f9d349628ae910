# thr.sh: per-thread CPU over one replay each: P/D paced at 80 ms, colocated-cache, P/D unpaced.
# thr_replay.py is session 29's with PACE=S setting the decode worker's step interval:
cd /work/main
sed -e 's/ttft_slo_s=50, tbt_slo_s=5, model="tiny", \*\*extra)/ttft_slo_s=50, tbt_slo_s=5, model="tiny", **extra, **({"decode_step_interval_s": float(os.environ["PACE"])} if os.environ.get("PACE") else {}))/' \
    docs/data/issue16_s29/thr_replay.py > /tmp/s33/thr_replay.py
export PYTHONPATH=/work/main/docs/data/issue16_s29 PMK_THREADS=1
PACE=0.08 .venv/bin/python /tmp/s33/thr_replay.py global-cache > /tmp/s33/thr_pd80.json 2>/tmp/s33/thr_pd80.err
.venv/bin/python /tmp/s33/thr_replay.py colocated-cache > /tmp/s33/thr_col.json 2>/tmp/s33/thr_col.err
.venv/bin/python /tmp/s33/thr_replay.py global-cache > /tmp/s33/thr_pd0.json 2>/tmp/s33/thr_pd0.err
# the instrumented pair (inst/): PMK_INST=1 with PYTHONPATH as above, PACE=0.08 for global-cache,
# then python3 docs/data/issue16_s29/showinst.py and docs/data/issue16_s29/fit.py
echo done
