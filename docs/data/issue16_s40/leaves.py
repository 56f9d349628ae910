"""Leaf functions of one thread's py-spy raw profile (gzip'd), as a share of its samples.
Usage: python leaves.py FILE.raw.gz THREAD-NAME-PART [N]"""
import collections, gzip, re, sys

c, tot = collections.Counter(), 0
for line in gzip.open(sys.argv[1], "rt"):
    stack, _, n = line.rstrip().rpartition(" ")
    frames = stack.split(";")
    if sys.argv[2] not in frames[0]:
        continue
    tot += int(n)
    c[re.sub(r" \((.*)\)", lambda m: "@" + m.group(1).split("/")[-1], frames[-1])] += int(n)
print(sys.argv[1], sys.argv[2], tot, "samples")
for k, v in c.most_common(int(sys.argv[3]) if len(sys.argv) > 3 else 10):
    print(f"  {100 * v / tot:5.1f}%  {k}")
