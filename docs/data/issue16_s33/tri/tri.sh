# tri.sh: rounds of three bench serving runs on main (rotating order): P/D unpaced (pd0),
# P/D with --decode-step-interval-s 0.08 (pd80), colocated-cache (col). JSON in /tmp/s33/tri.
cd /work/main
run() {  # name round
  case $1 in
    pd0) .venv/bin/python -m pymooncake bench serving --configs global-cache --json ;;
    pd80) .venv/bin/python -m pymooncake bench serving --configs global-cache --decode-step-interval-s 0.08 --json ;;
    col) .venv/bin/python -m pymooncake bench serving --configs colocated-cache --json ;;
  esac > /tmp/s33/tri/$1_$2.json 2>/dev/null
  python3 -c "
import json; d=json.load(open('/tmp/s33/tri/$1_$2.json')); (n,r),=d['results'].items()
c=r['cluster_cpu_s']; print('$2 $1', c, 'tbt', round(r['tbt_mean_s']*1e3,1), 'ttft', round(r['ttft_mean_s']*1e3), 'cached', r['cached_tokens'], flush=True)"
}
for rnd in 1 2 3; do
  case $((rnd % 3)) in
    1) order="pd0 pd80 col" ;; 2) order="pd80 col pd0" ;; 0) order="col pd0 pd80" ;;
  esac
  for n in $order; do run $n $rnd; done
done
