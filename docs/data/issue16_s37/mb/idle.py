import sys, os, time, argparse, json, glob
from harness import bench_args, snap
from pymooncake.cli.bench_serving import cluster_spec
from pymooncake.cli.cluster import LocalCluster
name, secs = sys.argv[1], float(sys.argv[2])
args = bench_args()
c = LocalCluster(cluster_spec(name, args)); c.start()
try:
    time.sleep(3)
    s0 = snap(c); c0 = c.cpu_seconds(); time.sleep(secs); s1 = snap(c); c1 = c.cpu_seconds()
    print(name, {k: round(c1[k] - c0[k], 2) for k in c1})
    for nm in s1:
        print("  ", nm, {t: round(v - s0[nm]["thr"].get(t, 0), 3) for t, v in s1[nm]["thr"].items() if v - s0[nm]["thr"].get(t, 0) >= 0.005})
finally:
    c.stop()
