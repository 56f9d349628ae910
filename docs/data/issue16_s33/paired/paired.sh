# paired.sh: bench serving --paired 10, P/D (unpaced / paced at 80 ms) against colocated-cache, ABBA
cd /work/main
i=0
for pace in 0 0.08 0.08 0; do
  i=$((i+1))
  .venv/bin/python -m pymooncake bench serving --configs global-cache,colocated-cache --paired 10 \
      --decode-step-interval-s $pace --json > /tmp/s33/paired/run${i}_pace${pace}.json 2> /tmp/s33/paired/run${i}.err
  python3 -c "
import json; d=json.load(open('/tmp/s33/paired/run${i}_pace${pace}.json')); p=d['paired']['global-cache/colocated-cache']
r=d['results']; print('run $i pace $pace', 'ratio', round(p['ratio'],3), 'slices', round(p['slice_median'],3), [round(x,2) for x in p['slice_ratios']], {n: v['cluster_cpu_s'] for n, v in r.items()}, 'tbt', {n: round(v['tbt_mean_s']*1e3,1) for n, v in r.items()}, 'cached', {n: v['cached_tokens'] for n, v in r.items()}, flush=True)"
done
echo done
