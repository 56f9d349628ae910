"""CPU per metadata call of one client (ours vs the wheel), one process, calls one after another."""
import sys, time, os, cProfile, pstats
side = sys.argv[1]
N = 5000
if side == "mooncake":
    sys.path.append("/tmp/mcvenv/lib/python3.11/site-packages")
from pymooncake.bench import store_procs as sp
from pymooncake.bench.store_meta import _store
cm = sp._pymooncake_cluster(0) if side == "ours" else sp._mooncake_cluster()
with cm as t:
    addr, md = t[0], t[1]
    s = _store(side)
    assert s.setup("localhost", md, 64 << 20, 16 << 20, "tcp", "", addr) == 0
    assert s.put("k1", bytes(1024)) == 0
    for _ in range(500): s.is_exist("k1")
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(N): s.is_exist("k1")
    c1, w1 = time.process_time(), time.perf_counter()
    print(f"{side}: client CPU {1e6*(c1-c0)/N:.1f} us/call, wall {1e6*(w1-w0)/N:.1f} us/call")
    if len(sys.argv) > 2:
        pr = cProfile.Profile(); pr.enable()
        for _ in range(N): s.is_exist("k1")
        pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(14)
    s.close()
