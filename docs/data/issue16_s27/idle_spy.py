import sys, time, json, subprocess
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
    c.start(); time.sleep(8)
    out = subprocess.run("ps -eo pid,args | grep 'pymooncake \\(prefill\\|decode\\|master\\|conductor\\)' | grep -v grep", shell=True, capture_output=True, text=True).stdout
    print(out)
    procs = []
    for line in out.strip().splitlines():
        pid, args = line.split(None, 1)
        tag = args.split("--id ")[1].split()[0] if "--id " in args else args.split()[3]
        procs.append(subprocess.Popen(["strace", "-c", "-f", "-o", f"/tmp/s27/idle/{name}_{tag}.strace", "-p", pid]))
    time.sleep(15)
    for p in procs: p.send_signal(2)
    for p in procs: p.wait()
finally:
    c.stop()
