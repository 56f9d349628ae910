"""Sequential same-prompt CPU: P/D vs colocated, one request at a time (no contention)."""
import sys, json, random, time, argparse
import httpx
from pymooncake.cli.bench_serving import cluster_spec
from pymooncake.cli.cluster import LocalCluster
if __name__ == "__main__":
    L = int(sys.argv[1]); OUTT = int(sys.argv[2]); M = int(sys.argv[3]); R = int(sys.argv[4])
    args = argparse.Namespace(prefill=2, decode=1, global_segment_size=512 << 20, ttft_slo=5.0,
                              tbt_slo=0.5, model="tiny", decode_step_interval_s=0.0)
    names = ["global-cache", "colocated-cache"]
    cl = {}
    try:
        for n in names:
            c = LocalCluster(cluster_spec(n, args)); c.start(); cl[n] = c
        rnd = random.Random(1)
        tot = {n: [] for n in names}; per = {n: {} for n in names}
        with httpx.Client(timeout=60) as h:
            for r in range(R):
                for n in (names if r % 2 == 0 else names[::-1]):
                    prompts = [[rnd.randrange(3, 250) for _ in range(L)] for _ in range(M)]
                    c = cl[n]; c0 = c.cpu_seconds()
                    for p in prompts:
                        body = {"prompt": p, "max_tokens": OUTT, "temperature": 0, "ignore_eos": True}
                        x = h.post(f"{c.url}/v1/completions", json=body); x.raise_for_status()
                    time.sleep(0.3)
                    c1 = c.cpu_seconds()
                    d = {k: c1[k] - c0[k] for k in c1}
                    tot[n].append(sum(d.values()) / M * 1e3)
                    for k, v in d.items(): per[n].setdefault(k, []).append(v / M * 1e3)
        import statistics as s
        for n in names:
            print(n, "ms CPU/request median", round(s.median(tot[n]), 1), [round(x, 1) for x in tot[n]])
            print("   ", {k: round(s.median(v), 2) for k, v in per[n].items()})
        print("ratio", round(s.median(tot[names[0]]) / s.median(tot[names[1]]), 3))
    finally:
        for c in cl.values(): c.stop()
