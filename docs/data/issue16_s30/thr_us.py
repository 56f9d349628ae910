# thr_us.py CONFIG: thr_replay.py (issue16_s29) with user and system CPU and minor faults per
# thread, and processes tagged by their command's words. The thr/*.json files of session 30
# were taken before that fix: their "master" entry is the conductor.
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
                   ttft_slo_s=50, tbt_slo_s=5, model="tiny", **extra)
def procs():
    out = subprocess.run("ps -eo pid,args | grep 'pymooncake \\(prefill\\|decode\\|master\\|conductor\\|colocated\\)' | grep -v grep", shell=True, capture_output=True, text=True).stdout
    res = {}
    for line in out.strip().splitlines():
        pid, args = line.split(None, 1)
        words = args.split()   # (not a substring test: the conductor's flags hold "--master")
        tag = words[words.index("--id") + 1] if "--id" in words else next(a for a in ("master", "conductor") if a in words)
        res[tag] = pid
    return res
def ticks(pid):
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            f = open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()
            out[t] = (int(f[11]), int(f[12]), int(f[7]))
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
            av = a[k].get(t, (0, 0, 0)); dv = ((v[0]-av[0])/100, (v[1]-av[1])/100, v[2]-av[2])
            if dv[0] + dv[1] > 0 or dv[2]:
                n = names.get(int(t), t)
                d[n] = dv
        out[k] = dict(sorted(d.items(), key=lambda x: -x[1][0]-x[1][1])[:4])
    print(json.dumps(out))
finally:
    c.stop()
