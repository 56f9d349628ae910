import sys, json
from pymooncake.bench import store_meta, store_procs
if __name__ == "__main__":
    if sys.argv[1] != "-":
        store_procs.MASTER_FLAGS[:] = ["--rpc-poll", sys.argv[1]]
    r = store_meta._round("ours", 20000, 4, 16)
    print(json.dumps({op: r[op][0] for op in store_meta.OPS}), flush=True)
