import json,sys,glob
for f in sorted(glob.glob('/tmp/s29/inst/*.json')):
    d=json.load(open(f)); print(f.split('/')[-1])
    for k,(ns,n) in sorted(d['st'].items()):
        if k in ('prefill_tokens','riding_decodes','decode_rows'): print(f'  {k:22s} {ns}  steps={n}'); continue
        print(f'  {k:22s} {ns/1e9:7.3f}s  n={n}  {ns/max(n,1)/1e3:8.1f}us')
    for k,v in sorted(d['tasks'].items(), key=lambda x:-x[1])[:9]: print('    ',k,v)
