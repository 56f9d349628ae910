"""LocalCluster start-up time of each named bench config (tiny model, bench serving's cluster).
Usage: .venv/bin/python docs/data/issue16_s40/startup.py global-cache,colocated-cache"""
import sys, time
sys.path.insert(0, "docs/data/issue16_s37/mb")
from harness import bench_args
from pymooncake.cli.bench_serving import cluster_spec
from pymooncake.cli.cluster import LocalCluster
for name in sys.argv[1].split(","):
    c = LocalCluster(cluster_spec(name, bench_args(10)))
    t = time.perf_counter(); c.start(); dt = time.perf_counter() - t
    c.stop(); print(name, "start %.2f s" % dt, flush=True)
