import json, subprocess, sys, time
from pymooncake.cli.cluster import ClusterSpec, LocalCluster
which = sys.argv[1]
cfg = {"pd": ({"policy": "global-cache"}, 2, 1), "co": ({"colocated": True}, 3, 0)}[which]
spec = ClusterSpec(port=0, quiet=True, max_model_len=8192, num_kv_blocks=2048,
                   global_segment_size=512 << 20, num_prefill=cfg[1], num_decode=cfg[2],
                   ttft_slo_s=50, tbt_slo_s=5, model="tiny", **cfg[0])
c = LocalCluster(spec)
try:
    c.start()
    pids = c.pids()
    recs = [subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-F", "999", "-g", "-o", f"/tmp/s21/perf/cpu_{which}_{n}.data", "-p", str(p)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for n, p in pids.items()]
    time.sleep(1)
    cpu0 = c.cpu_seconds()
    r = subprocess.run([sys.executable, "-m", "pymooncake", "replay", "--url", c.url, "--limit", "300",
                        "--time-scale", "1.0", "--length-scale", "32", "--ttft-slo", "5.0",
                        "--tbt-slo", "0.5", "--json"], capture_output=True, text=True, timeout=1800)
    cpu1 = c.cpu_seconds()
    print(which, {k: round(cpu1[k] - cpu0[k], 2) for k in cpu1}, round(sum(cpu1[k] - cpu0[k] for k in cpu1), 2))
    for p in recs: p.send_signal(2)
    for p in recs: p.wait(60)
finally:
    c.stop()
