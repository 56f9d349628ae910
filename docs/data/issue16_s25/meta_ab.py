import os, sys, json
sys.path.append("/tmp/mcvenv/lib/python3.11/site-packages")
from pymooncake.bench import store_meta as sm, store_procs as sp
VARIANTS = {"base": [], "g50": ["--rpc-poll", "5e-5"], "g100": ["--rpc-poll", "1e-4"]}
def main():
    rounds = int(sys.argv[1]); out = []
    names = list(VARIANTS) + ["mooncake"]
    for r in range(rounds):
        for side in (names if r % 2 == 0 else names[::-1]):
            if side != "mooncake": sp.MASTER_FLAGS[:] = VARIANTS[side]
            res = sm._round("mooncake" if side == "mooncake" else "ours", 20000, 4, 16)
            row = {op: round(v[0]) for op, v in res.items()}
            print(r, side, row, flush=True); out.append((r, side, row))
            json.dump(out, open(sys.argv[2], "w"))
if __name__ == "__main__":
    main()
