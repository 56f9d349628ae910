import json, glob, numpy as np, sys
for f in sorted(glob.glob("/tmp/s37/inst_*.json")):
    d = json.load(open(f))
    rows = []; per = {}
    for nm, p in d["procs"].items():
        for seqs, ns, t in p["pf"]:
            pre = [(n, s) for n, s in seqs if n > 1 or s == 0]
            dec = [(n, s) for n, s in seqs if not (n > 1 or s == 0)]
            tok = sum(n for n, s in pre); pairs = sum(n * s + n * (n + 1) / 2 for n, s in pre)
            rows.append((tok, pairs, len(dec), ns / 1e6, nm))
    A = np.array([[r[0], r[1] / 1e3, r[2], 1] for r in rows]); y = np.array([r[3] for r in rows])
    coef, *_ = np.linalg.lstsq(A, y, rcond=None)
    tot_tok = A[:, 0].sum(); tot_pairs = A[:, 1].sum(); tot_ms = y.sum()
    by = {}
    for r in rows: by.setdefault(r[4], [0, 0, 0]); by[r[4]][0] += r[3]; by[r[4]][1] += r[0]; by[r[4]][2] += r[1]
    print(f.split("inst_")[1][:-5], "steps", len(rows), "tok", int(tot_tok), "kpairs", int(tot_pairs), "exec s", round(tot_ms / 1e3, 2),
          "fit ms/tok %.4f ms/kpair %.4f ms/dec %.3f const %.3f" % tuple(coef),
          {k: (round(v[0] / 1e3, 2), v[1], int(v[2] / 1e3)) for k, v in by.items()})
