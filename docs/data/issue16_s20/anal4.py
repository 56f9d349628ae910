import json, sys
import numpy as np
d = sys.argv[1]
for grp in (["decode-0"], ["colocated-0","colocated-1","colocated-2"]):
    rows=[]
    for n in grp:
        rows += [r[:10] for r in json.load(open(f"{d}/rec_{n}.json"))["steps"]]
    A = np.array(rows, dtype=float)
    npf, ndec, ptok, attn, dctx, loads, cpu, ts, te, wall = A.T
    for b in range(1, 6):
        m = (npf==0)&(ndec==b)
        if m.sum() < 5: continue
        print(grp[0], "batch", b, "n", m.sum(), "cpu %.3f exec %.3f wall %.3f ctx/req %.0f  loads %d  p10 %.3f p50 %.3f p90 %.3f" % (cpu[m].mean()*1e3, te[m].mean()*1e3, wall[m].mean()*1e3, (dctx[m]/b).mean(), loads[m].sum(), *(np.percentile(cpu[m],[10,50,90])*1e3)))
