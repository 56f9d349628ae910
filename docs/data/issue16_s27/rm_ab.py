import os, sys, json, subprocess, statistics
V = sys.argv[3].split(",")
def one(var):
    poll, adapt = var.split(":")
    env = dict(os.environ, PYTHONPATH="/tmp/s27/sc", PMK_POLL=poll, PMK_ADAPT=adapt, N="5000")
    out = subprocess.run([sys.executable, "/tmp/s27/ph2.py", "is_exist,remove"], env=env, capture_output=True, text=True)
    return {l.split()[0]: float(l.split()[1]) for l in out.stdout.strip().splitlines() if "ops/s" in l}
res = {v: [] for v in V}
for r in range(int(sys.argv[1])):
    for v in (V if r % 2 == 0 else V[::-1]):
        res[v].append(one(v))
    print(r, {v: res[v][-1] for v in V}, flush=True)
json.dump(res, open(sys.argv[2], "w"))
for v in V:
    for op in ("is_exist", "remove"):
        xs = sorted(x[op] for x in res[v]); print(v, op, "median", round(statistics.median(xs)), "q", [round(x) for x in xs])
