import collections, sys, glob
def load(files):
    incl = collections.Counter(); tot = 0; thr = collections.Counter()
    for f in files:
        for line in open(f):
            stack, _, n = line.rstrip().rpartition(" ")
            n = int(n); fr = stack.split(";")
            tot += n
            thr[f.split("_")[-1][:-4] + ":" + fr[0].split("): ")[-1]] += n
            for x in set(fr[1:]): incl[x] += n
    return incl, tot, thr
a, ta, tha = load(sorted(glob.glob(sys.argv[1])))
b, tb, thb = load(sorted(glob.glob(sys.argv[2])))
print("total", ta, tb)
for k, v in (tha + thb).most_common(20): print(f"  {tha[k]:6d} {thb[k]:6d} {k}")
keys = sorted(set(a) | set(b), key=lambda k: -abs(a[k] - b[k]))
for k in keys[:int(sys.argv[3]) if len(sys.argv) > 3 else 60]:
    print(f"{a[k]:6d} {b[k]:6d} {a[k]-b[k]:+6d} {k[:120]}")
