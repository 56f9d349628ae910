import subprocess, sys, collections, bisect
data, maps = sys.argv[1], sys.argv[2:]
regions = []
for mp in maps:
    for line in open(mp):
        f = line.split()
        a, b = (int(x, 16) for x in f[0].split("-"))
        name = f[5] if len(f) > 5 else "[anon]"
        if "pymooncake-" in name: name = "shm"
        sz = b - a
        kind = f"{name} {f[1]} " + ("256K" if sz == 256 << 10 else f"{sz>>20}M")
        regions.append((a, b, kind))
regions = sorted(set(regions))
starts = [r[0] for r in regions]
out = subprocess.run(["perf", "script", "-i", data, "-F", "event,addr"], capture_output=True, text=True).stdout
c = collections.Counter()
for line in out.splitlines():
    if "page-faults" not in line: continue
    addr = int(line.split()[-1], 16)
    i = bisect.bisect_right(starts, addr) - 1
    r = regions[i][2] if i >= 0 and regions[i][0] <= addr < regions[i][1] else "?"
    c[r] += 1
print(sum(c.values()))
for k, v in c.most_common(12): print(v, k)
