import sys, collections
tot = 0; incl = collections.Counter(); leaf = collections.Counter()
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(" ")
    n = int(n); tot += n
    frames = stack.split(";")
    seen = set()
    for f in frames:
        name = f.split(" (")[0]
        if name not in seen:
            incl[name] += n; seen.add(name)
    leaf[frames[-1]] += n
print("total", tot)
print("-- inclusive")
for k, v in incl.most_common(int(sys.argv[2]) if len(sys.argv) > 2 else 40): print(f"{100*v/tot:5.1f}% {k}")
print("-- leaf")
for k, v in leaf.most_common(25): print(f"{100*v/tot:5.1f}% {k}")
