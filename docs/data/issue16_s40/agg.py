"""Per-function inclusive samples of two py-spy raw profiles (plain or gzip'd) and their
difference, largest first. Usage: python agg.py A B [N]"""
import collections, gzip, re, sys


def load(f):
    opener = gzip.open if f.endswith(".gz") else open
    out = []
    for line in opener(f, "rt"):
        stack, _, n = line.rstrip().rpartition(" ")
        frames = [re.sub(r" \((.*)\)", lambda m: "@" + m.group(1).split("/")[-1].split(":")[0], x)
                  for x in stack.split(";")]
        out.append((frames, int(n)))
    return out


def inclusive(samples):
    c = collections.Counter()
    for frames, n in samples:
        for x in set(frames[1:]):   # frames[0] is the thread
            c[x] += n
    return c


a, b = load(sys.argv[1]), load(sys.argv[2])
print("total", sum(n for _, n in a), sum(n for _, n in b))
ca, cb = inclusive(a), inclusive(b)
for k in sorted(set(ca) | set(cb), key=lambda k: -(ca[k] - cb[k]))[:int(sys.argv[3]) if len(sys.argv) > 3 else 40]:
    print(f"{ca[k]:6d} {cb[k]:6d} {ca[k] - cb[k]:+6d}  {k[:150]}")
