# idle.py CONFIG SECONDS [strace]: CPU-s of each cluster process over SECONDS with no
# requests; with "strace", `strace -c -f` of each engine, master and conductor process for
# 15 s instead (summaries in /tmp/s27/idle/CONFIG_PROC.strace).
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
    c.start(); time.sleep(10)
    if sys.argv[3:] == ["strace"]:
        out = subprocess.run("ps -eo pid,args | grep 'pymooncake \\(prefill\\|decode\\|master\\|"
                             "conductor\\)' | grep -v grep", shell=True, capture_output=True,
                             text=True).stdout
        procs = []
        for line in out.strip().splitlines():
            pid, args = line.split(None, 1)
            tag = args.split("--id ")[1].split()[0] if "--id " in args else args.split()[3]
            procs.append(subprocess.Popen(["strace", "-c", "-f", "-o",
                                           f"/tmp/s27/idle/{name}_{tag}.strace", "-p", pid]))
        time.sleep(15)
        for p in procs: p.send_signal(2)
        for p in procs: p.wait()
    else:
        a = c.cpu_seconds(); time.sleep(float(sys.argv[2])); b = c.cpu_seconds()
        print(name, json.dumps({k: round(b[k] - a[k], 3) for k in b}))
finally:
    c.stop()
