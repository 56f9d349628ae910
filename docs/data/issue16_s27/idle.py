import sys, time, json
from pymooncake.cli.cluster import ClusterSpec, LocalCluster
from pymooncake.cli.bench_serving import BENCH_CONFIGS
name = sys.argv[1]; extra = BENCH_CONFIGS[name]
spec = ClusterSpec(port=0, quiet=True, max_model_len=8192, num_kv_blocks=2048,
                   global_segment_size=512 << 20,
                   num_prefill=3 if extra.get("colocated") else 2,
                   num_decode=0 if extra.get("colocated") else 1,
                   ttft_slo_s=50, tbt_slo_s=5, model="tiny", **extra)
c = LocalCluster(spec)
try:
    c.start(); time.sleep(10)
    a = c.cpu_seconds(); time.sleep(float(sys.argv[2])); b = c.cpu_seconds()
    print(name, json.dumps({k: round(b[k] - a[k], 3) for k in b}))
finally:
    c.stop()
