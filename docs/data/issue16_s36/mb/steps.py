import sys, os, time, argparse, subprocess, json, glob
from pymooncake.cli.bench_serving import cluster_spec, replay_argv
from pymooncake.cli.cluster import LocalCluster
if __name__ == "__main__":
    name, lim = sys.argv[1], int(sys.argv[2])
    args = argparse.Namespace(prefill=2, decode=1, global_segment_size=512 << 20, ttft_slo=5.0,
                              tbt_slo=0.5, model="tiny", decode_step_interval_s=float(os.environ.get("PACE", "0")),
                              limit=lim, time_scale=1.0, length_scale=32)
    for f in glob.glob("/tmp/s36/steps/*.json"): os.remove(f)
    c = LocalCluster(cluster_spec(name, args)); c.start()
    try:
        time.sleep(2)
        def snap():
            out = {}
            for nm, pid in c.pids().items():
                try: out[nm] = json.load(open(f"/tmp/s36/steps/{pid}.json"))
                except Exception: pass
            return out
        s0 = snap(); c0 = c.cpu_seconds()
        r = subprocess.run(replay_argv(c.url, args, skip=0, limit=lim), capture_output=True, text=True)
        time.sleep(1.5); c1 = c.cpu_seconds(); s1 = snap()
        rep = json.loads(r.stdout)
        print("cpu", {k: round(c1[k] - c0[k], 2) for k in c1}, "tbt ms", round(rep["tbt_mean_s"] * 1e3, 1))
        for nm in s1:
            if nm not in s0: continue
            a, b = s0[nm], s1[nm]
            st = b["steps"] - a["steps"]; rows = b["rows"] - a["rows"]
            hist = {k: b["hist"].get(k, 0) - a["hist"].get(k, 0) for k in b["hist"]}
            print(nm, "steps", st, "rows", rows, "step cpu s", round((b["cpu_ns"] - a["cpu_ns"]) / 1e9, 2), "exec cpu s", round((b.get("ex_ns",0) - a.get("ex_ns",0)) / 1e9, 2), "hist", dict(sorted(hist.items(), key=lambda x: int(x[0]))))
    finally:
        c.stop()
