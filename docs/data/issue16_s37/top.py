import collections, sys
for fn in sys.argv[1:]:
    tot=0; self_=collections.Counter(); incl=collections.Counter()
    for line in open(fn):
        line=line.rstrip()
        if not line: continue
        stack,_,n=line.rpartition(' ')
        n=int(n); frames=stack.split(';')
        tot+=n
        self_[frames[-1]]+=n
        for f in set(frames): incl[f]+=n
    print("=====", fn, tot)
    for k,v in incl.most_common(45): print(v, k)
