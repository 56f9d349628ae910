import sys, os, time, argparse, subprocess
from harness import bench_args, snap
from pymooncake.cli.bench_serving import cluster_spec
from pymooncake.cli.cluster import LocalCluster
args = bench_args()
c = LocalCluster(cluster_spec("global-cache", args)); c.start()
try:
    time.sleep(3)
    for who in ("prefill-0", "decode-0", "master", "conductor"):
        pid = c.pids()[who]
        r = subprocess.run(["timeout", "-s", "INT", "5", "strace", "-f", "-c", "-p", str(pid)], capture_output=True, text=True)
        print("=====", who); print("\n".join(r.stderr.splitlines()[:14]))
finally:
    c.stop()
