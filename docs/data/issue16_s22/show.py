import json, sys, glob
for f in sorted(sum([glob.glob(a) for a in sys.argv[1:]], [])):
    try: d = json.load(open(f))['results']
    except Exception as e: print(f, 'bad', e); continue
    p, c = d['global-cache'], d['colocated-cache']
    pc, cc = p['cluster_cpu_s'], c['cluster_cpu_s']
    pw = sum(v for k, v in pc.items() if k.startswith('prefill'))
    cw = sum(v for k, v in cc.items() if k.startswith('colocated'))
    print(f"{f.split('/')[-1]:22s} PD {pc['total']:6.2f} CO {cc['total']:6.2f} ratio {pc['total']/cc['total']:.3f} | pf {pw:5.2f} cw {cw:5.2f} dec {pc.get('decode-0',0):4.2f} | master {pc['master']:.2f}/{cc['master']:.2f} cond {pc['conductor']:.2f}/{cc['conductor']:.2f} | ttft {p['ttft_mean_s']:.3f}/{c['ttft_mean_s']:.3f} failed {p['num_failed']}/{c['num_failed']}")
