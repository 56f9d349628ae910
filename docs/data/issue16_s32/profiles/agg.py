import collections, sys
f, key = sys.argv[1], sys.argv[2]
tot=0; own=collections.Counter(); incl=collections.Counter()
for line in open(f):
    stack,n=line.rstrip().rsplit(" ",1); n=int(n)
    fr=stack.split(";")
    if not any(key in x for x in fr): continue
    tot+=n; own[fr[-1]]+=n
    for x in set(fr): incl[x]+=n
print("samples", tot)
print("--- inclusive"); [print(f"{c:6d} {c/tot*100:5.1f}% {x}") for x,c in incl.most_common(int(sys.argv[3]) if len(sys.argv)>3 else 50)]
print("--- self"); [print(f"{c:6d} {c/tot*100:5.1f}% {x}") for x,c in own.most_common(30)]
