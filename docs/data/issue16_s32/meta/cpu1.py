"""CPU µs per call (client process + master process), one client, sequential; both sides."""
import sys, os
sys.path.append("/tmp/mcvenv/lib/python3.11/site-packages")
os.environ["PATH"] = "/tmp/mcvenv/bin:" + os.environ["PATH"]
import sys, time, os
from pymooncake.bench import store_procs as sp
from pymooncake.bench.store_meta import _store
N = 20000
if os.environ.get("MPOLL"):  # cpu2.txt: MPOLL=0 (the master's --rpc-poll)
    sp.MASTER_FLAGS[:] = ["--rpc-poll", os.environ["MPOLL"]]
def master_cpu():
    return sp._cpu_s(sp._HELPERS) - time.process_time()
def go(side):
    cm = sp._mooncake_cluster() if side == "mooncake" else sp._pymooncake_cluster(0)
    with cm as t:
        addr, md = t[0], t[1]
        holder = _store(side)
        assert holder.setup("localhost", md, 64 << 20, 16 << 20, "tcp", "", addr) == 0
        keys = [f"meta-key-{i}" for i in range(256)]
        for k in keys: assert holder.put(k, bytes(1024)) == 0
        s = _store(side)
        assert s.setup("localhost", md, 0, 16 << 20, "tcp", "", addr) == 0
        groups = [[keys[(i * 16 + j) % 256] for j in range(16)] for i in range(N)]
        for _ in range(500): s.is_exist("meta-key-1")
        out = []
        for name, f in (("ex", lambda i: s.is_exist(keys[i % 256])), ("bex", lambda i: s.batch_is_exist(groups[i])),
                        ("gs", lambda i: s.get_size(keys[i % 256]))):
            c0, m0, w0 = time.process_time(), master_cpu(), time.perf_counter()
            for i in range(N): f(i)
            w, c, m = time.perf_counter() - w0, time.process_time() - c0, master_cpu() - m0
            out.append(f"{name}: wall {1e6*w/N:.1f} client {1e6*c/N:.1f} master {1e6*m/N:.1f}")
        s.close(); holder.close()
    return out
if __name__ == "__main__":
    for rep in range(2):
        for side in os.environ.get("SIDES", "ours,mooncake").split(","):
            print(side, " | ".join(go(side)), flush=True)
