cd /tmp/s32
for rnd in 1 2 3; do
 for p in 0 0.08; do
  PMK_PACE_S=$p PYTHONPATH=/tmp/s32/P/src /work/main/.venv/bin/python -m pymooncake bench serving --configs global-cache --json > pace/pd_${p}_$rnd.json 2>/dev/null
  python3 -c "
import json,sys; r=json.load(open('pace/pd_${p}_$rnd.json'))['results']['global-cache']
c=r['cluster_cpu_s']; print('$rnd pace=$p', c, 'tbt', round(r['tbt_mean_s']*1e3,1), 'ttft', round(r['ttft_mean_s']*1e3), flush=True)"
 done
done
