import collections, sys
# drop waits; show inclusive by function for the remainder
skip = ("EpollSelector.select", "_write_to_self", "Condition.wait", "DecodeLayers.run", "Event.wait", "sleep")
self_c=collections.Counter(); incl=collections.Counter(); tot=0
for line in open(sys.argv[1]):
    stack, n = line.rsplit(" ",1); n=int(n)
    fr = stack.split(";")
    if any(fr[-1].startswith(s) for s in skip): continue
    tot+=n
    self_c[fr[-1]]+=n
    for f in set(fr): incl[f]+=n
print("kept samples", tot, "= %.2f s" % (tot/200))
for f,n in incl.most_common(int(sys.argv[2])): print(f"{n/200:6.2f}s incl {f}")
