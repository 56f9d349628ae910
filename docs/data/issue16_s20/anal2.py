import json, sys, os
import numpy as np
d = sys.argv[1]
def load(grp):
    rows=[]
    for n in grp:
        j = json.load(open(f"{d}/rec_{n}.json"))
        rows += [r[:7] for r in j["steps"]]
    return np.array(rows, dtype=float)
P = load(["prefill-0","prefill-1"]); C = load(["colocated-0","colocated-1","colocated-2"])
def X(A): return np.stack([np.ones(len(A)), A[:,2], A[:,3]/1e6, A[:,1]], 1)
for nm, A in (("pd", P), ("co", C)):
    m = A[:,0] > 0
    B = A[m]
    coef, *_ = np.linalg.lstsq(X(B), B[:,6], rcond=None)
    print(nm, "coef", np.round(coef*1e3, 4), "n", len(B))
    globals()[nm] = (B, coef)
Bp, cp = pd; Bc, cc = co
print("pd steps actual %.2f, predicted by co fit %.2f" % (Bp[:,6].sum(), (X(Bp)@cc).sum()))
print("co steps actual %.2f, predicted by pd fit %.2f" % (Bc[:,6].sum(), (X(Bc)@cp).sum()))
# bins by ptok
for lo, hi in ((0,128),(128,512),(512,1024),(1024,2049)):
    for nm,B in (("pd",Bp),("co",Bc)):
        m=(B[:,2]>=lo)&(B[:,2]<hi)&(B[:,1]==0)
        if m.sum(): print(f"  {nm} ptok[{lo},{hi}) n={m.sum():4d} ms/step {B[m,6].mean()*1e3:7.2f} ptok {B[m,2].mean():7.0f} attnM {B[m,3].mean()/1e6:6.3f}  ms/tok {B[m,6].sum()/B[m,2].sum()*1e3:.4f}")
