import pstats, sys
def load(f):
    st = pstats.Stats(f).stats
    tot = {}; cum = {}
    for (fn, ln, name), (cc, nc, tt, ct, callers) in st.items():
        k = f"{name}@{fn.split('/')[-1]}:{ln}"
        tot[k] = (tt, nc); cum[k] = ct
    return tot, cum
a, ac = load(sys.argv[1]); b, bc = load(sys.argv[2])
mode = sys.argv[3] if len(sys.argv) > 3 else "tot"
print("total tottime", round(sum(v[0] for v in a.values()), 2), round(sum(v[0] for v in b.values()), 2))
if mode == "tot":
    keys = sorted(set(a) | set(b), key=lambda k: -(a.get(k, (0, 0))[0] - b.get(k, (0, 0))[0]))
    for k in keys[:45]:
        print(f"{a.get(k,(0,0))[0]:7.3f} {b.get(k,(0,0))[0]:7.3f} {a.get(k,(0,0))[0]-b.get(k,(0,0))[0]:+7.3f}  n={a.get(k,(0,0))[1]}/{b.get(k,(0,0))[1]}  {k[:110]}")
else:
    keys = sorted(set(ac) | set(bc), key=lambda k: -(ac.get(k, 0) - bc.get(k, 0)))
    for k in keys[:60]:
        print(f"{ac.get(k,0):7.3f} {bc.get(k,0):7.3f} {ac.get(k,0)-bc.get(k,0):+7.3f}  n={a.get(k,(0,0))[1]}/{b.get(k,(0,0))[1]}  {k[:110]}")
