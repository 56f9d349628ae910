"""Wall µs per call, one client, calls one after another: is_exist and remove."""
import sys, time
from pymooncake.bench import store_procs as sp
from pymooncake.bench.store_meta import _store
N = 6000
with sp._pymooncake_cluster(0) as t:
    s = _store("ours")
    assert s.setup("localhost", t[1], 64 << 20, 16 << 20, "tcp", "", t[0]) == 0
    assert s.put("k1", bytes(1024)) == 0
    out = []
    for rnd in range(3):
        keys = [f"rm-{rnd}-{i}" for i in range(N)]
        for k in keys: assert s.put(k, bytes(1024)) == 0
        for _ in range(300): s.is_exist("k1")
        w0 = time.perf_counter()
        for i in range(N): s.is_exist("k1")
        w1 = time.perf_counter()
        for k in keys: s.remove(k)
        w2 = time.perf_counter()
        out.append((1e6*(w1-w0)/N, 1e6*(w2-w1)/N))
    s.close()
print(" ".join(f"ex={a:.1f} rm={b:.1f}" for a, b in out))
