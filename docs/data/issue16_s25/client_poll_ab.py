import os, sys, json, subprocess
def main():
    out = []
    for r in range(3):
        for p in (["5e-5", "2e-5", "0"] if r % 2 == 0 else ["0", "2e-5", "5e-5"]):
            env = dict(os.environ, PMK_POLL=p, PYTHONPATH="/tmp/s25/scp:/work/main/src")
            res = subprocess.run([sys.executable, "-c", "import sys; sys.argv=['x']; from pymooncake.bench import store_meta as sm\nif __name__=='__main__':\n import json; res=sm._round('ours',20000,4,16); print(json.dumps({k: round(v[0]) for k,v in res.items()}))"], env=env, capture_output=True, text=True)
            row = json.loads(res.stdout.strip().splitlines()[-1])
            print(r, p, row, flush=True); out.append((r, p, row))
    json.dump(out, open("/tmp/s25/cpoll.json", "w"))
main()
