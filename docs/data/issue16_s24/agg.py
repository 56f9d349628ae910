import sys, collections, re
f = sys.argv[1]; topn = int(sys.argv[2]) if len(sys.argv) > 2 else 25
filt = sys.argv[3] if len(sys.argv) > 3 else None
incl = collections.Counter(); selfc = collections.Counter(); thr = collections.Counter(); tot = 0
for line in open(f):
    line = line.rstrip()
    if not line: continue
    stack, _, cnt = line.rpartition(" ")
    cnt = int(cnt)
    frames = stack.split(";")
    t = frames[0]
    if filt and not any(filt in fr for fr in frames): continue
    tot += cnt; thr[t] += cnt
    fs = [re.sub(r" \(/.*?/(src|site-packages|lib/python3.11)/", " (", fr) for fr in frames[1:]]
    for fr in set(fs): incl[fr] += cnt
    if fs: selfc[fs[-1]] += cnt
print("total", tot, "samples (200 Hz =>", tot/200, "s)")
for t, c in thr.most_common(8): print(f"  {c/200:7.2f}s {t}")
print("--- inclusive")
for fr, c in incl.most_common(topn): print(f"  {c/200:7.2f}s {fr[:150]}")
print("--- self")
for fr, c in selfc.most_common(topn): print(f"  {c/200:7.2f}s {fr[:150]}")
