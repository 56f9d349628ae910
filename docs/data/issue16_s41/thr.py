"""Per-thread CPU seconds (utime+stime from /proc) of every cluster process through one
serving replay; thread names from py-spy dump --json (os_thread_id)."""
import argparse, json, os, subprocess, sys, time, collections
from pymooncake.cli.bench_serving import cluster_spec, replay_argv
from pymooncake.cli.cluster import LocalCluster
TCK = os.sysconf("SC_CLK_TCK")
def tasks(pid):
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            f = open(f"/proc/{pid}/task/{t}/stat").read()
        except OSError:
            continue
        rest = f[f.rindex(")") + 2:].split()
        out[int(t)] = (int(rest[11]) + int(rest[12])) / TCK, int(rest[11]) / TCK, int(rest[12]) / TCK
    return out
def names(pid):
    r = subprocess.run([".venv/bin/py-spy", "dump", "-p", str(pid), "--json", "--nonblocking"], capture_output=True, text=True)
    try:
        return {t["os_thread_id"]: t["thread_name"] or str(t["thread_id"]) for t in json.loads(r.stdout)}
    except Exception:
        return {}
name, lim = sys.argv[1], int(sys.argv[2])
args = argparse.Namespace(prefill=2, decode=1, global_segment_size=512 << 20, ttft_slo=5.0, tbt_slo=0.5, model="tiny",
                          decode_step_interval_s=0.0, limit=lim, time_scale=1.0, length_scale=32)
c = LocalCluster(cluster_spec(name, args)); c.start()
try:
    pids = c.pids(); time.sleep(1)
    t0 = {w: tasks(p) for w, p in pids.items()}
    r = subprocess.run(replay_argv(c.url, args, skip=0, limit=lim), capture_output=True, text=True)
    t1 = {w: tasks(p) for w, p in pids.items()}
    nm = {w: names(p) for w, p in pids.items()}
    res = {}
    for w in pids:
        per = collections.Counter(); us = collections.Counter()
        for tid, (tot, u, s) in t1[w].items():
            b = t0[w].get(tid, (0, 0, 0))
            n = nm[w].get(tid, "?")
            per[n] += tot - b[0]; us[n + ":sys"] += s - b[2]
        res[w] = {k: round(v, 2) for k, v in per.most_common() if v > 0.005}
        res[w]["_sys"] = round(sum(us.values()), 2)
        res[w]["_total"] = round(sum(per.values()), 2)
    print(json.dumps({"config": name, "threads": res}, indent=1))
finally:
    c.stop()
