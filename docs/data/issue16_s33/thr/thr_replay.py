# thr_replay.py CONFIG: one bench-serving-shaped replay; per-thread CPU of each cluster
# process over the replay window (/proc ticks; thread names from the sitecustomize dumps)
import sys, json, os, subprocess, time, glob
from pymooncake.cli.cluster import ClusterSpec, LocalCluster
from pymooncake.cli.bench_serving import BENCH_CONFIGS
name = sys.argv[1]; extra = BENCH_CONFIGS[name]
spec = ClusterSpec(port=0, quiet=True, max_model_len=8192, num_kv_blocks=2048,
                   global_segment_size=512 << 20,
                   num_prefill=3 if extra.get("colocated") else 2,
                   num_decode=0 if extra.get("colocated") else 1,
                   ttft_slo_s=50, tbt_slo_s=5, model="tiny", **extra, **({"decode_step_interval_s": float(os.environ["PACE"])} if os.environ.get("PACE") else {}))
def procs():
    out = subprocess.run("ps -eo pid,args | grep 'pymooncake \\(prefill\\|decode\\|master\\|conductor\\|colocated\\)' | grep -v grep", shell=True, capture_output=True, text=True).stdout
    res = {}
    for line in out.strip().splitlines():
        pid, args = line.split(None, 1)
        tag = args.split("--id ")[1].split()[0] if "--id " in args else next(a for a in ("master", "conductor") if a in args)
        res[tag] = pid
    return res
def ticks(pid):
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            f = open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()
            out[t] = int(f[11]) + int(f[12])
        except OSError:
            pass
    return out
c = LocalCluster(spec)
try:
    c.start(); time.sleep(3)
    ps = procs()
    a = {k: ticks(p) for k, p in ps.items()}
    argv = [sys.executable, "-m", "pymooncake", "replay", "--url", c.url, "--limit", "300",
            "--time-scale", "1.0", "--length-scale", "32", "--ttft-slo", "5", "--tbt-slo", "0.5", "--json"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    b = {k: ticks(p) for k, p in ps.items()}
    time.sleep(2.5)
    out = {}
    for k in ps:
        names = {}
        try:
            names = {int(x.split(":", 1)[0]): x.split(":", 1)[1] for x in json.load(open(f"/tmp/s29/thr/{k}.json"))}
        except Exception:
            pass
        d = {}
        for t, v in b[k].items():
            dv = (v - a[k].get(t, 0)) / 100
            if dv > 0:
                n = names.get(int(t), t)
                d[n] = round(d.get(n, 0) + dv, 2)
        out[k] = {"total": round(sum(d.values()), 2), **dict(sorted(d.items(), key=lambda x: -x[1]))}
    print(json.dumps(out))
finally:
    c.stop()
