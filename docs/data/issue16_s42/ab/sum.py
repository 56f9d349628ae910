import json, glob, sys, statistics as st
d = sys.argv[1] if len(sys.argv) > 1 else "docs/data/issue16_s42/ab"
rows = {}
for f in sorted(glob.glob(d + "/*_*.json")):
    v, i = f.split("/")[-1][:-5].split("_")
    for r in json.load(open(f)):
        if r["op"] in ("put", "get"):
            rows.setdefault((r["op"], r["size_bytes"]), {}).setdefault(v, []).append(
                (r["ratio"], r["ratio_q1"], r["ratio_q3"], r["p50_s"] * 1e3, r["mooncake_p50_s"] * 1e3,
                 r["throughput_bytes_per_s"] / 1e6, r["mooncake_throughput_bytes_per_s"] / 1e6, r["cpu_s_per_op"] * 1e3, r["mooncake_cpu_s_per_op"] * 1e3))
for (op, sz), per in sorted(rows.items()):
    for v, xs in sorted(per.items(), reverse=True):
        print(f"{op} {sz >> 10:6d} KiB {v:3s} " + " | ".join(
            "ratio %.2f [%.2f-%.2f] ours %.0f MB/s mc %.0f, cpu %.2f/%.2f ms" % (x[0], x[1], x[2], x[5], x[6], x[7], x[8]) for x in xs))
