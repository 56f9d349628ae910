# metadata ops paired with Mooncake at several in-flight depths (store_meta.run, 5 rounds each)
import sys, json
sys.path.append("/tmp/mcvenv/lib/python3.11/site-packages")
from pymooncake.bench import store_meta as sm
if __name__ == "__main__":
    out = {}
    for c in [int(x) for x in sys.argv[1].split(",")]:
        rows = sm.run(ops=20000, clients=c, batch=16, repeat=int(sys.argv[2]))
        out[c] = rows
        for r in rows:
            print(f"clients {c} {r['op']:15s} {r['ops_per_s']:9.0f} vs {r['mooncake_ops_per_s']:9.0f}  ratio {r['ratio']:.2f} [q {r['ratio_q1']:.2f}-{r['ratio_q3']:.2f}, {r['ratio_min']:.2f}-{r['ratio_max']:.2f}] ok={r['verified']}", flush=True)
    json.dump(out, open(sys.argv[3], "w"), indent=1)
