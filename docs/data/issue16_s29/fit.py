# fit.py [INST_DIR]: prefill steps of one instrumented global-cache + colocated-cache
# replay (sitecustomize.py, PMK_INST=1; default ./inst): a least-squares line of each
# cluster's prefill-step CPU in (tokens, tokens x context, 1), and each cluster's steps
# costed with the other's line — is a P/D prefill token dearer than a colocated one?
import glob, json, sys
import numpy as np
d = sys.argv[1] if len(sys.argv) > 1 else "inst"
groups = {"pd": [], "co": []}
for f in sorted(glob.glob(f"{d}/*.json")):
    name = f.split("/")[-1]
    if name.startswith("decode"):
        continue
    groups["pd" if name.startswith("prefill") else "co"] += json.load(open(f))["steps"]
def mat(steps):
    return (np.array([[s[0], s[1] / 1e3, 1] for s in steps], float),
            np.array([s[3] / 1e6 for s in steps]))
coef = {}
for g, steps in groups.items():
    a, y = mat(steps)
    coef[g] = np.linalg.lstsq(a, y, rcond=None)[0]
    print(f"{g}: {len(steps)} steps, {a[:, 0].sum():.0f} tokens, {y.sum() / 1e3:.2f} s, "
          f"{y.sum() / a[:, 0].sum():.4f} ms a token")
for g, o in (("pd", "co"), ("co", "pd")):
    a, y = mat(groups[g])
    print(f"{g} steps: {y.sum() / 1e3:.2f} s measured, {(a @ coef[o]).sum() / 1e3:.2f} s at {o}'s line")
