import collections, sys
self_c=collections.Counter(); incl=collections.Counter(); thr=collections.Counter(); tot=0
for line in open(sys.argv[1]):
    stack, n = line.rsplit(" ",1); n=int(n); tot+=n
    fr = stack.split(";")
    thr[fr[0]] += n
    self_c[fr[-1]]+=n
    for f in set(fr): incl[f]+=n
print("total samples", tot, "(200 Hz -> %.2f s)" % (tot/200))
for f,n in thr.most_common(8): print(f"{100*n/tot:5.1f}% thread {f}")
for f,n in self_c.most_common(int(sys.argv[2]) if len(sys.argv)>2 else 25): print(f"{100*n/tot:5.1f}% self {f}")
print()
for f,n in incl.most_common(int(sys.argv[3]) if len(sys.argv)>3 else 50): print(f"{100*n/tot:5.1f}% incl {f}")
