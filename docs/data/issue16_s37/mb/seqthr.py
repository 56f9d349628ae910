"""Sequential same-prompt CPU by thread: P/D vs colocated, one request at a time."""
import sys, json, random, time, argparse, glob, os
import httpx
from harness import bench_args, snap
from pymooncake.cli.bench_serving import cluster_spec
from pymooncake.cli.cluster import LocalCluster
L = int(sys.argv[1]); OUTT = int(sys.argv[2]); M = int(sys.argv[3]); R = int(sys.argv[4])
args = bench_args()
names = ["global-cache", "colocated-cache"]
cl = {n: LocalCluster(cluster_spec(n, args)) for n in names}


def one_round(h, c, prompts):
    """The prompts one after another (greedy, OUTT tokens each); the dumps around them."""
    time.sleep(1.2)
    before = snap(c)
    for p in prompts:
        h.post(f"{c.url}/v1/completions", json={"prompt": p, "max_tokens": OUTT, "temperature": 0,
                                                 "ignore_eos": True}).raise_for_status()
    time.sleep(1.2)
    return before, snap(c)


try:
    for c in cl.values():
        c.start()
    rnd = random.Random(1)
    acc = {n: {} for n in names}
    with httpx.Client(timeout=60) as h:
        for r in range(R):
            for n in (names if r % 2 == 0 else names[::-1]):
                s0, s1 = one_round(h, cl[n], [[rnd.randrange(3, 250) for _ in range(L)]
                                              for _ in range(M)])
                for proc in s1:
                    if proc not in s0: continue
                    for key in ("steps", "rows", "cpu_ns", "ex_ns", "dl_ns"):
                        if key in s1[proc]:
                            d = s1[proc][key] - s0[proc][key]
                            acc[n].setdefault(proc + "/#" + key, []).append(d / M * (1e-3 if key.endswith("ns") else 1e3))
                    for t, v in s1[proc].get("fn", {}).items():
                        d = v - s0[proc].get("fn", {}).get(t, 0)
                        acc[n].setdefault(proc + "/fn." + t, []).append(d / M * 1e-3)
                    for t, v in s1[proc]["thr"].items():
                        d = v - s0[proc]["thr"].get(t, 0)
                        acc[n].setdefault(proc + "/" + t, []).append(d / M * 1e3)
    import statistics as s
    for n in names:
        print(n)
        tot = 0
        for k, v in sorted(acc[n].items()):
            m = s.median(v)
            tot += m if "/#" not in k and "/fn." not in k else 0
            if m >= 0.2: print(f"   {k:60s} {m:7.2f}")
        print("   total of medians", round(tot, 1))
finally:
    for c in cl.values(): c.stop()
