# two instances of the same configuration, paired slice by slice (A B, B A, ...): how far
# apart do two identical clusters land? (the "cluster instance level" of session 33)
import argparse, json, os, subprocess, sys
from contextlib import ExitStack
from pymooncake.cli import bench_serving as bs
from pymooncake.cli.bench_serving_paired import merge
def main():
    cfg, k, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    import argparse as ap
    top = ap.ArgumentParser(); sub = top.add_subparsers()
    bs.register_bench(sub)
    ns = top.parse_args(["serving", "--configs", cfg])
    print(vars(ns), flush=True)
    names = ["A", "B"]
    bounds = [ns.limit * i // k for i in range(k + 1)]
    slices = {n: [] for n in names}
    with ExitStack() as st:
        cl = {}
        for n in names:
            c = bs.LocalCluster(bs.cluster_spec(cfg, ns)); st.callback(c.stop); c.start(); cl[n] = c
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            for n in (names if i % 2 == 0 else names[::-1]):
                c = cl[n]; c0 = c.cpu_seconds()
                r = subprocess.run(bs.replay_argv(c.url, ns, skip=lo, limit=hi), capture_output=True, text=True, timeout=1800)
                c1 = c.cpu_seconds(); assert r.returncode == 0, r.stderr[-500:]
                res = json.loads(r.stdout)
                cpu = {p: round(c1[p] - c0[p], 2) for p in c1 if p in c0}
                res["cluster_cpu_s"] = {"total": round(sum(cpu.values()), 2), **cpu}
                slices[n].append(res)
                print(i, n, res["cluster_cpu_s"], flush=True)
    res = {n: merge(s) for n, s in slices.items()}
    per = [a / b for a, b in zip(res["A"]["slice_cpu_s"], res["B"]["slice_cpu_s"])]
    print("A/B", res["A"]["cluster_cpu_s"], res["B"]["cluster_cpu_s"],
          round(res["A"]["cluster_cpu_s"]["total"] / res["B"]["cluster_cpu_s"]["total"], 3),
          [round(x, 3) for x in per], flush=True)
    json.dump({"results": res, "slice_ratios": per}, open(out, "w"), indent=1)
if __name__ == "__main__":
    main()
