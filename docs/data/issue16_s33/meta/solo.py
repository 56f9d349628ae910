import sys
from pymooncake.bench import store_meta as sm
if __name__ == "__main__":
    for sides in (["ours"], ["ours", "mooncake"], ["ours"], ["mooncake", "ours"], ["mooncake"]):
        r = sm._round(sides, 20000, 4, 16)
        print(sides, {s: {op: round(v[0]) for op, v in d.items()} for s, d in r.items()}, flush=True)
