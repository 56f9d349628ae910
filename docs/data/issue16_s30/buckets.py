# buckets.py [INST_DIR]: prefill-step CPU per token by step size, per process, from one
# instrumented global-cache + colocated-cache pair (issue16_s29/sitecustomize.py, PMK_INST=1).
# The steps include each worker's start-up profile, so these are not replay-window totals.
import glob, json, sys
import numpy as np
d = sys.argv[1] if len(sys.argv) > 1 else "inst"
for f in sorted(glob.glob(f"{d}/*.json")):
    name = f.split("/")[-1]
    if name.startswith(("decode", "thr"))  # (thread dumps live in ../thr):
        continue
    s = json.load(open(f))["steps"]
    t = np.array([x[0] for x in s]); ms = np.array([x[3] / 1e6 for x in s])
    seqs = np.mean([len(x[4]) for x in s])
    print(f"{name}: {len(s)} steps, {t.sum()} tokens, median step {int(np.median(t))} tokens, "
          f"{seqs:.2f} sequences a step, {ms.sum() / t.sum():.3f} ms a token")
    for lo, hi in ((0, 64), (64, 256), (256, 512), (512, 1024), (1024, 4096)):
        m = (t >= lo) & (t < hi)
        if m.any():
            print(f"   steps of [{lo},{hi}) tokens: {m.sum():3d} steps, {t[m].sum():6d} tokens, "
                  f"{ms[m].sum() / t[m].sum():.3f} ms a token")
