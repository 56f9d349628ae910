"""One replay of the first LIMIT trace requests on a fresh cluster of CONFIG, with the
sitecustomize counters: writes /tmp/s37/inst_TAG.json and prints the CPU per process and,
per engine process, steps, rows, model execution, DecodeLayers time by rows and the timed
functions. Usage: PMK_STEPS=1 PYTHONPATH=<this folder> [PACE=s] python inst.py CONFIG LIMIT TAG"""
import glob, json, os, subprocess, sys, time
from harness import bench_args, snap
from pymooncake.cli.bench_serving import cluster_spec, replay_argv
from pymooncake.cli.cluster import LocalCluster


def delta(b, a):
    """b - a for numbers, dicts of numbers and [count, ns] pairs."""
    if isinstance(b, dict):
        return {k: delta(v, a.get(k, 0 if not isinstance(v, (dict, list)) else type(v)()))
                for k, v in b.items()}
    if isinstance(b, list) and len(b) == 2 and all(isinstance(x, int) for x in b):
        a = a or [0, 0]
        return [b[0] - a[0], b[1] - a[1]]
    return b - a


name, lim, tag = sys.argv[1], int(sys.argv[2]), sys.argv[3]
args = bench_args(lim)
os.makedirs("/tmp/s37/steps", exist_ok=True)
for f in glob.glob("/tmp/s37/steps/*.json"):
    os.remove(f)
c = LocalCluster(cluster_spec(name, args))
c.start()
try:
    time.sleep(2)
    s0, c0 = snap(c), c.cpu_seconds()
    r = subprocess.run(replay_argv(c.url, args, skip=0, limit=lim), capture_output=True, text=True)
    time.sleep(1.5)
    c1, s1 = c.cpu_seconds(), snap(c)
    rep = json.loads(r.stdout)
    cpu = {k: round(c1[k] - c0[k], 2) for k in c1}
    out = {"cpu": cpu, "total": round(sum(cpu.values()), 2), "rep": rep, "procs": {}}
    for nm, b in s1.items():
        a = s0.get(nm, {})
        p = {k: delta(b[k], a.get(k, type(b[k])())) for k in
             ("thr", "steps", "ex_ns", "dl_ns", "dl_rows", "hist", "fn", "rpc") if k in b}
        p["pf"] = b.get("pf", [])[len(a.get("pf", [])):]
        out["procs"][nm] = p
    with open(f"/tmp/s37/inst_{tag}.json", "w") as fh:
        json.dump(out, fh)
    print(tag, name, out["total"], cpu, "tbt ms", round(rep["tbt_mean_s"] * 1e3, 1),
          "cached", rep.get("cached_tokens"))
    for nm, p in out["procs"].items():
        if p.get("steps"):
            dl = {k: (v[0], round(v[1] / max(1, v[0]) / 1e6, 3)) for k, v in p["dl_rows"].items()}
            print(" ", nm, "steps", p["steps"], "exec s", round(p["ex_ns"] / 1e9, 2),
                  "DecodeLayers s", round(p["dl_ns"] / 1e9, 2), "(calls, ms a call) by rows", dl,
                  "fn s", {k: round(v / 1e9, 3) for k, v in p["fn"].items()})
finally:
    c.stop()
