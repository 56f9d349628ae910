# verdicts.py DIR: session 29's verdicts of a session-35 final.sh run (cma4m added).
# with session 27's verdicts from the per-round ratio's quartiles: met (q1 reaches the
# target), missed (q3 below it), not distinguishable (anything else).
import json, sys, statistics
d = sys.argv[1]
def verdict(q1, q3, target):
    return "met" if q1 >= target else ("missed" if q3 < target else "not distinguishable")
def quart(xs):
    xs = sorted(xs); q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]
for r in json.load(open(f"{d}/store.json")):
    if r["op"] in ("put", "get"):
        target = 1.2 if r["size_bytes"] == 16 << 20 else 1.0
        print(f"store {r['mode']:8s} {r['op']} {r['size_bytes'] >> 10:6d} KiB  ratio {r['ratio']:.2f} "
              f"[q {r['ratio_q1']:.2f}-{r['ratio_q3']:.2f}] -> {verdict(r['ratio_q1'], r['ratio_q3'], target)}")
    elif r["mode"] == "metadata_ops":
        print(f"meta {r['op']:15s} {r['ops_per_s']:9.0f} vs {r['mooncake_ops_per_s']:9.0f} /s (keys) "
              f"ratio {r['ratio']:.2f} [q {r['ratio_q1']:.2f}-{r['ratio_q3']:.2f}] -> {verdict(r['ratio_q1'], r['ratio_q3'], 1.5)}")
for name, ref, target in (("tcp4k", "mooncake", 1.0), ("tcp16m", "socket", 0.8), ("shm4m", "memcpy", 0.8),
                          ("cma4m", "memcpy", 0.8)):
    t = json.load(open(f"{d}/{name}.json"))
    ours, peer = t["figures"]["pymooncake"]["values"], t["figures"][ref]["values"]
    q1, med, q3 = quart([a / b for a, b in zip(ours, peer)])
    extra = f" ({t['ratio_vs_mooncake']:.2f}x Mooncake)" if name == "tcp16m" else ""
    print(f"TE {name:7s} vs {ref:8s} {med:.3f} [q {q1:.2f}-{q3:.2f}]{extra} -> {verdict(q1, q3, target)}")
