import collections, glob, re, sys
O=sys.argv[1]
def load(f):
    return {(l.split()[0], l.split()[1]): int(l.split()[2]) for l in open(f)}
a=load(O+"/t0.txt"); b=load(O+"/t1.txt")
names={}
for f in glob.glob(O+"/dump_*.txt"):
    pid=f.split("_")[-1][:-4]
    txt=open(f).read()
    for m in re.finditer(r'Thread (0x[0-9a-f]+|\d+) \((\w+)\): "([^"]*)"', txt):
        pass
    for m in re.finditer(r'Thread (\d+) \((?:\w+)\): "([^"]*)"', txt):
        names[(pid, m.group(1))]=m.group(2)
    for m in re.finditer(r'Thread (\d+) \((?:\w+)(?:, gil)?\): "([^"]*)"', txt):
        names[(pid, m.group(1))]=m.group(2)
tot=collections.defaultdict(float)
for k,v in sorted(b.items()):
    d=(v-a.get(k,0))/100
    tot[k[0]]+=d
    if d>0.03: print(k, names.get(k,"?"), round(d,2))
print(dict(tot))
