"""RPCs each process served over one replay of the first LIMIT requests of CONFIG.
Usage: PMK_STEPS=1 PYTHONPATH=<this folder> python rpcs.py CONFIG LIMIT"""
import subprocess, sys, time
from harness import bench_args, snap
from pymooncake.cli.bench_serving import cluster_spec, replay_argv
from pymooncake.cli.cluster import LocalCluster

name, lim = sys.argv[1], int(sys.argv[2])
args = bench_args(lim, pace=0.0)
c = LocalCluster(cluster_spec(name, args))
c.start()
try:
    time.sleep(3)
    s0 = snap(c)
    subprocess.run(replay_argv(c.url, args, skip=0, limit=lim), capture_output=True, text=True)
    time.sleep(1.5)
    s1 = snap(c)
    for nm in s1:
        a, b = s0[nm].get("rpc", {}), s1[nm].get("rpc", {})
        print(nm, {k: v - a.get(k, 0) for k, v in sorted(b.items()) if v - a.get(k, 0)},
              s1[nm].get("rpc_err", ""))
finally:
    c.stop()
