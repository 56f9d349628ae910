import subprocess, sys, collections, re, glob
def agg(files, key):
    c = collections.Counter(); tot = 0
    for f in files:
        out = subprocess.run(["perf", "report", "-i", f, "--no-children", "--sort", key, "--stdio", "-g", "none", "--percent-limit", "0", "-F", "sample," + key.replace("dso,sym","dso,sym")], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if not line.strip() or line.startswith("#"): continue
            m = re.match(r"\s*(\d+)\s+(.*)$", line)
            if m:
                n = int(m.group(1)); c[re.sub(r"\s+", " ", m.group(2).strip())] += n; tot += n
    return c, tot
key = sys.argv[1]
pd, tpd = agg(sorted(glob.glob("cpu_pd_*.data")), key)
co, tco = agg(sorted(glob.glob("cpu_co_*.data")), key)
print("total samples pd", tpd, "co", tco)
rows = sorted(set(pd) | set(co), key=lambda k: -(pd[k] + co[k]))
for k in rows[:int(sys.argv[2]) if len(sys.argv) > 2 else 40]:
    print(f"{pd[k]/1000:7.2f} {co[k]/1000:7.2f} {(pd[k]-co[k])/1000:+7.2f}  {k[:110]}")
