# master CPU and client CPU per call: is_exist vs get_size vs remove, one client, N calls, R rounds
import sys, time, os
from pymooncake.bench import store_procs as sp
from pymooncake.store.compat import MooncakeDistributedStore
N = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
R = int(sys.argv[2]) if len(sys.argv) > 2 else 3
MiB = 1 << 20
def mcpu():
    return sp._helpers_cpu_s(list(sp._HELPERS))
import os
if os.environ.get("NOPOLL"): sp.MASTER_FLAGS = [*sp.MASTER_FLAGS, "--rpc-poll", "0"]
with sp._pymooncake_cluster(0) as (addr, md, _):
    h = MooncakeDistributedStore(); assert h.setup("localhost", md, 256 * MiB, 16 * MiB, "tcp", "", addr) == 0
    c = MooncakeDistributedStore(); assert c.setup("localhost", md, 0, 16 * MiB, "tcp", "", addr) == 0
    keys = [f"k-{i}" for i in range(256)]
    for k in keys: assert h.put(k, bytes(1024)) == 0
    for r in range(R):
        mine = [f"rm-{r}-{i}" for i in range(N)]
        for k in mine: assert c.put(k, bytes(1024)) == 0
        for op in ("is_exist", "get_size", "remove"):
            m0, c0, t0 = mcpu(), time.thread_time(), time.perf_counter()
            if op == "is_exist":
                for i in range(N): c.is_exist(keys[i & 255])
            elif op == "get_size":
                for i in range(N): c.get_size(keys[i & 255])
            else:
                for k in mine: assert c.remove(k) == 0
            m1, c1, t1 = mcpu(), time.thread_time(), time.perf_counter()
            print(f"round {r} {op:9s} wall {(t1-t0)/N*1e6:6.1f} us  client cpu {(c1-c0)/N*1e6:6.1f} us  master cpu {(m1-m0)/N*1e6:6.1f} us", flush=True)
    c.close(); h.close()
