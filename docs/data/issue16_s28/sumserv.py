import json, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/run_*.json")):
    try:
        d = json.load(open(f))
    except Exception as e:
        print(f, "incomplete", e); continue
    r = d["results"]
    g, c = r.get("global-cache"), r.get("colocated-cache")
    line = f"{f.split('/')[-1]}:"
    for n, x in r.items():
        cpu = x["cluster_cpu_s"]
        line += f" {n} cpu {cpu['total']} ({', '.join(f'{k} {v}' for k, v in cpu.items() if k != 'total')}) tbt {x['tbt_mean_s']*1e3:.1f} ms ttft {x['ttft_mean_s']*1e3:.0f} ms cached {x['cached_tokens']} |"
    if g and c:
        line += f" ratio {g['cluster_cpu_s']['total'] / c['cluster_cpu_s']['total']:.3f}"
    print(line)
