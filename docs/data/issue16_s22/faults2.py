import subprocess, collections, sys
out = subprocess.run(["perf", "script", "-i", sys.argv[1], "-F", "tid,ip,sym,dso"], capture_output=True, text=True).stdout
c = collections.Counter(); t = collections.Counter()
for block in out.split("\n\n"):
    lines = [l.strip() for l in block.strip().splitlines()]
    if len(lines) < 2 or "clear_page_erms" not in lines[1]: continue
    tid = lines[0].split()[0]
    t[tid] += 1
    user = [l for l in lines[1:] if "kernel.kallsyms" not in l]
    c[(tid, user[0].split(None, 1)[1][:70] if user else "?")] += 1
print(t)
for k, v in c.most_common(12): print(v, k)
