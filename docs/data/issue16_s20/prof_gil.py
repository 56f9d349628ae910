"""Replay global-cache (or colocated) with py-spy on every cluster process."""
import json, subprocess, sys, time
from pymooncake.cli.cluster import ClusterSpec, LocalCluster
which = sys.argv[1]; tag = sys.argv[2]; limit = sys.argv[3] if len(sys.argv) > 3 else "300"
PYSPY = "/tmp/pd17/pyspy/bin/py-spy"
RATE = "1000"; WHO = ("master", "conductor", "decode-0", "prefill-0", "prefill-1", "colocated-0", "colocated-1", "colocated-2")
cfg = {"pd": ({"policy": "global-cache"}, 2, 1), "co": ({"colocated": True}, 3, 0)}[which]
spec = ClusterSpec(port=0, quiet=True, max_model_len=8192, num_kv_blocks=2048,
                   global_segment_size=512 << 20, num_prefill=cfg[1], num_decode=cfg[2],
                   ttft_slo_s=50, tbt_slo_s=5, model="tiny", **cfg[0])
c = LocalCluster(spec)
try:
    c.start()
    spies = [subprocess.Popen([PYSPY, "record", "--nonblocking", "--threads", "--gil", "-r", RATE, "-f", "raw",
                               "-o", f"/tmp/s20/prof_{tag}_{n}.txt", "--pid", str(p)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for n, p in c.pids().items() if n in WHO]
    time.sleep(1)
    cpu0 = c.cpu_seconds()
    r = subprocess.run([sys.executable, "-m", "pymooncake", "replay", "--url", c.url, "--limit", limit,
                        "--time-scale", "1.0", "--length-scale", "32", "--ttft-slo", "5.0",
                        "--tbt-slo", "0.5", "--json"], capture_output=True, text=True, timeout=1800)
    cpu1 = c.cpu_seconds()
    d = json.loads(r.stdout)
    print(json.dumps({"n": d["num_requests"], "cpu": {k: round(cpu1[k] - cpu0[k], 2) for k in cpu1}}))
    for s in spies:
        s.send_signal(2)
    for s in spies:
        s.wait(30)
finally:
    c.stop()
