import os, sys, json, subprocess
sys.path.append("/tmp/mcvenv/lib/python3.11/site-packages")
VARIANTS = ["5e-5", "1e-4", "1.5e-4", "2.5e-4"]
def one(side, poll):
    env = dict(os.environ, PYTHONPATH="/tmp/s27/sc", PMK_POLL=poll or "5e-5")
    code = ("import sys, json; sys.path.append('/tmp/mcvenv/lib/python3.11/site-packages')\n"
            "from pymooncake.bench import store_meta as sm\n"
            "if __name__ == '__main__':\n"
            f"    r = sm._round('{side}', 20000, 4, 16); print(json.dumps({{k: round(v[0]) for k, v in r.items()}}))\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])
def main():
    rounds = int(sys.argv[1]); res = []
    names = VARIANTS + ["mooncake"]
    for r in range(rounds):
        for side in (names if r % 2 == 0 else names[::-1]):
            row = one("mooncake", None) if side == "mooncake" else one("ours", side)
            print(r, side, row, flush=True); res.append((r, side, row))
            json.dump(res, open(sys.argv[2], "w"))
if __name__ == "__main__":
    main()
