"""Variants side by side: one P/D cluster per variant (env), all up at once; rounds of
M distinct 448-token prompts (max_tokens 1) sent to each in rotating order; prefill CPU per
round. Prints per-variant median ms/prompt."""
import sys, os, time, random, statistics
sys.path.insert(0, "/work/main/docs/data/issue16_s37/mb")
import httpx
from harness import bench_args
from pymooncake.cli.bench_serving import cluster_spec
from pymooncake.cli.cluster import LocalCluster
G = "glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824:glibc.malloc.top_pad=67108864"
VARS = {"base": {}, "glibc": {"GLIBC_TUNABLES": G}, "thp": {"THP_MEM_ALLOC_ENABLE": "1"},
        "base2": {}, "glibc2": {"GLIBC_TUNABLES": G}}
names = sys.argv[1].split(","); R = int(sys.argv[2]); M = int(sys.argv[3]); L = int(sys.argv[4]) if len(sys.argv) > 4 else 448
def cpu(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
cl = {}
try:
    for n in names:
        saved = dict(os.environ); os.environ.update(VARS[n])
        cl[n] = LocalCluster(cluster_spec("global-cache", bench_args())); cl[n].start()
        os.environ.clear(); os.environ.update(saved)
    rnd = random.Random(11)
    acc = {n: [] for n in names}
    with httpx.Client(timeout=120) as h:
        for n in names:  # warm-up
            for _ in range(3):
                h.post(f"{cl[n].url}/v1/completions", json={"prompt": [rnd.randrange(3, 250) for _ in range(L)], "max_tokens": 1}).raise_for_status()
        for r in range(R):
            order = names[r % len(names):] + names[:r % len(names)]
            if r % 2: order = order[::-1]
            prompts = [[rnd.randrange(3, 250) for _ in range(L)] for _ in range(M)]
            for n in order:
                pids = [p for k, p in cl[n].pids().items() if k.startswith("prefill")]
                c0 = sum(cpu(p) for p in pids)
                for p in prompts:
                    h.post(f"{cl[n].url}/v1/completions", json={"prompt": p, "max_tokens": 1}).raise_for_status()
                acc[n].append((sum(cpu(p) for p in pids) - c0) / M * 1e3)
    for n in names:
        v = acc[n]
        print(f"{n:7s} median {statistics.median(v):6.1f} ms/prompt  rounds {[round(x) for x in v]}")
finally:
    for c in cl.values(): c.stop()
