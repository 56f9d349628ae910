import sys, random, time, argparse, json, glob, os
import httpx
from pymooncake.cli.bench_serving import cluster_spec
from pymooncake.cli.cluster import LocalCluster
if __name__ == "__main__":
    name, N, inst = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    args = argparse.Namespace(prefill=2, decode=1, global_segment_size=512 << 20, ttft_slo=5.0,
                              tbt_slo=0.5, model="tiny", decode_step_interval_s=0.0)
    for i in range(inst):
        for f in glob.glob("/tmp/s36/att/*.json"): os.remove(f)
        c = LocalCluster(cluster_spec(name, args)); c.start()
        try:
            time.sleep(4); rnd = random.Random(1)
            with httpx.Client(timeout=60) as h:
                for _ in range(N):
                    h.post(f"{c.url}/v1/completions", json={"prompt": [rnd.randrange(3,250) for _ in range(448)], "max_tokens": 2, "temperature": 0, "ignore_eos": True})
            time.sleep(1.5)
            for nm, pid in c.pids().items():
                f = f"/tmp/s36/att/{pid}.json"
                if not os.path.exists(f): continue
                try: d = json.load(open(f))
                except Exception: time.sleep(0.2); d = json.load(open(f))
                if d["n"] < 8: continue
                print(i, nm, f"{d.get('c448',0) / max(1,d.get('n448',0)) / 1e6:.2f} ms/call448 n {d.get('n448')}", {k: round(sorted(v)[len(v)//2]/1e6, 2) for k, v in d.get("bylayer", {}).items()}, flush=True)
        finally:
            c.stop()
