cd /tmp/s32
for rnd in 1 2 3; do
 for b in 0 512; do
  PYTHONPATH=/tmp/s32/M/src /work/main/.venv/bin/python /tmp/s32/chunk.py $b --configs global-cache --decode-interval-s 0.08 --json > /tmp/s32/chunk/pd_${b}_$rnd.json 2>/dev/null
  python3 -c "
import json; r=json.load(open('/tmp/s32/chunk/pd_${b}_$rnd.json'))['results']['global-cache']
c=r['cluster_cpu_s']; print('$rnd budget=$b', c, 'prefill', round(c['prefill-0']+c['prefill-1'],2), 'tbt', round(r['tbt_mean_s']*1e3,1), 'ttft', round(r['ttft_mean_s']*1e3), 'cached', r['cached_tokens'], flush=True)"
 done
done
