"""Per-step records of one replay pair (Engine.step timed with time.thread_time(); the
patch is docs/data/issue16_s20/step_records.diff): steps, prompts per step, decode-only
steps and their CPU, and the prefill steps' least-squares fit
CPU = a + b·tokens + c·(query×key pairs) (+ d·decodes + e·decode context, colocated).
Usage: python steps.py FOLDER   (FOLDER holds rec_<instance>.json)"""
import glob, json, sys
import numpy as np

folder = sys.argv[1]
def load(names):
    rows = []
    for n in names:
        rows += [r[:10] for r in json.load(open(f"{folder}/rec_{n}.json"))["steps"]]
    return np.array(rows, dtype=float)

names = sorted(f.split("rec_")[1][:-5] for f in glob.glob(f"{folder}/rec_*.json"))
for grp in ([n for n in names if n.startswith("prefill")], ["decode-0"],
            [n for n in names if n.startswith("colocated")]):
    if not grp:
        continue
    A = load(grp)
    npf, ndec, ptok, pairs, dctx, loads, cpu, ts, te, wall = A.T
    step = cpu + ts
    pf, dec = npf > 0, (npf == 0) & (ndec > 0)
    line = f"{'+'.join(grp):34s} steps {len(A):5d}: CPU {step.sum():6.2f} s"
    if pf.any():
        hist = np.bincount(npf[pf].astype(int))[1:]
        line += (f" | prefill steps {int(pf.sum())} ({step[pf].sum():.2f} s, prompts/step "
                 f"{[int(x) for x in hist]}, prompt tokens {int(ptok.sum())}, <64-token steps "
                 f"{int((pf & (ptok < 64)).sum())})")
    if dec.any():
        line += (f" | decode-only {int(dec.sum())} ({step[dec].sum():.2f} s, "
                 f"{1e3 * step[dec].mean():.3f} ms each, batch {ndec[dec].mean():.2f})")
    print(line)
    if pf.any():
        X = np.stack([np.ones(pf.sum()), ptok[pf], pairs[pf] / 1e6], 1)
        c, *_ = np.linalg.lstsq(X, step[pf], rcond=None)
        print(f"{'':34s} prefill-step fit: a {1e3 * c[0]:.2f} ms, b {1e3 * c[1]:.4f} ms/token, "
              f"c {c[2]:.3f} s per million pairs")
