import subprocess, collections, sys, re
def agg(files):
    c = collections.Counter()
    for f in files:
        out = subprocess.run(["perf", "report", "-i", f, "--no-children", "--sort", "dso,sym", "-g", "none", "--stdio", "-F", "period,dso,sym"],
                             capture_output=True, text=True).stdout
        for line in out.splitlines():
            if not line.strip() or line.startswith("#"): continue
            parts = line.split(None, 2)
            try: n = int(parts[0])
            except ValueError: continue
            dso = parts[1]; sym = parts[2] if len(parts) > 2 else "?"
            sym = re.sub(r"^\[[.k]\]\s+", "", sym.strip())[:90]
            if dso.startswith("[JIT]"): dso = "[JIT]"; sym = "jit"
            c[(dso, sym)] += n / 1e9
    return c
a = agg(sys.argv[1].split(",")); b = agg(sys.argv[2].split(","))
def bydso(c):
    d = collections.Counter()
    for (dso, s), v in c.items(): d[dso] += v
    return d
da, db = bydso(a), bydso(b)
print("total %.2f %.2f" % (sum(a.values()), sum(b.values())))
for k in sorted(set(da) | set(db), key=lambda k: -(da[k] + db[k]))[:12]:
    print(f"{da[k]:7.2f} {db[k]:7.2f} {da[k]-db[k]:+6.2f} {k}")
print("--- by symbol, largest differences")
for k in sorted(set(a) | set(b), key=lambda k: -abs(a[k] - b[k]))[:45]:
    print(f"{a[k]:7.3f} {b[k]:7.3f} {a[k]-b[k]:+6.3f} {k[0][:20]} {k[1]}")
