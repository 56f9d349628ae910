"""Per-instance prefill level: N fresh P/D clusters; per prefill worker, CPU for the same
sequential prompts (max_tokens 1), and its AnonHugePages."""
import sys, os, time, random, re
sys.path.insert(0, "/work/main/docs/data/issue16_s37/mb")
import httpx
from harness import bench_args
from pymooncake.cli.bench_serving import cluster_spec
from pymooncake.cli.cluster import LocalCluster
N = int(sys.argv[1]); M = int(sys.argv[2]); cfg = sys.argv[3] if len(sys.argv) > 3 else "global-cache"
def cpu(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
def thp(pid):
    s = open(f"/proc/{pid}/smaps_rollup").read()
    return {k: int(re.search(k + r":\s+(\d+)", s).group(1)) // 1024 for k in ("Rss", "AnonHugePages")}
for inst in range(N):
    c = LocalCluster(cluster_spec(cfg, bench_args())); c.start()
    try:
        rnd = random.Random(7)
        prompts = [[rnd.randrange(3, 250) for _ in range(448)] for _ in range(M)]
        with httpx.Client(timeout=60) as h:
            for p in prompts[:4]:
                h.post(f"{c.url}/v1/completions", json={"prompt": p, "max_tokens": 1}).raise_for_status()
            pids = c.pids(); c0 = {n: cpu(p) for n, p in pids.items()}
            for p in prompts:  # distinct prompts: no reuse (same list each instance)
                p = [rnd.randrange(3, 250)] + p[1:]
                h.post(f"{c.url}/v1/completions", json={"prompt": p, "max_tokens": 1}).raise_for_status()
            c1 = {n: cpu(p) for n, p in pids.items()}
        print(inst, {n: round(c1[n] - c0[n], 2) for n in pids}, {n: thp(p) for n, p in pids.items() if n.startswith(("prefill", "colocated"))}, flush=True)
    finally:
        c.stop()
