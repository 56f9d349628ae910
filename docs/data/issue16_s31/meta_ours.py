import sys
from pymooncake.bench import store_meta
if __name__ == "__main__":
    for _ in range(int(sys.argv[1])):
        r = store_meta._round("ours", 20000, 4, 16)
        print(" ".join(f"{op}={r[op][0]:.0f}" for op in store_meta.OPS), flush=True)
