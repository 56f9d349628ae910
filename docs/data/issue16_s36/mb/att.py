import sys, random, time, argparse, json, glob, os
import httpx
from pymooncake.cli.bench_serving import cluster_spec
from pymooncake.cli.cluster import LocalCluster
if __name__ == "__main__":
    L, OUTT, N = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    args = argparse.Namespace(prefill=2, decode=1, global_segment_size=512 << 20, ttft_slo=5.0,
                              tbt_slo=0.5, model="tiny", decode_step_interval_s=0.0)
    cl = {}
    try:
        for n in ("global-cache", "colocated-cache"):
            c = LocalCluster(cluster_spec(n, args)); c.start(); cl[n] = c
        time.sleep(4)
        def snap():
            out = {}
            for f in glob.glob("/tmp/s36/att/*.json"):
                try: d = json.load(open(f))
                except Exception: continue
                out[os.path.basename(f)] = d
            return out
        rnd = random.Random(1)
        with httpx.Client(timeout=60) as h:
            for r in range(int(os.environ.get("ROUNDS", "4"))):
                for n, c in (cl.items() if r % 2 == 0 else list(cl.items())[::-1]):
                    time.sleep(1.5); s0 = snap(); c0 = c.cpu_seconds()
                    for _ in range(N):
                        h.post(f"{c.url}/v1/completions", json={"prompt": [rnd.randrange(3,250) for _ in range(L)], "max_tokens": OUTT, "temperature": 0, "ignore_eos": True})
                    time.sleep(1.5); s1 = snap(); c1 = c.cpu_seconds()
                    pid2name = {v: k for k, v in c.pids().items()}
                    for f, d in s1.items():
                        pid = int(f.split('.')[0]); nm = pid2name.get(pid)
                        if nm is None or f not in s0: continue
                        dn = d["n"] - s0[f]["n"]
                        if dn == 0: continue
                        cpu = (d["cpu"] - s0[f]["cpu"]) / 1e6 / N; wall = (d["wall"] - s0[f]["wall"]) / 1e6 / N
                        pairs = (d["pairs"] - s0[f]["pairs"]) / N
                        print(f"r{r} {n:16s} {nm:12s} attn cpu {cpu:6.2f} ms/req wall {wall:6.2f} calls {dn/N:.1f}/req pairs {pairs/1e3:.0f}k ns/pair {cpu*1e6/pairs:.2f}  proc cpu {(c1[nm]-c0[nm])/N*1e3:.1f} ms/req", flush=True)
    finally:
        for c in cl.values(): c.stop()
