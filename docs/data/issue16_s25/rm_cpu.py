import sys, time, cProfile, pstats
from pymooncake.bench import store_procs as sp
from pymooncake.bench.store_meta import _store
N = 5000
with sp._pymooncake_cluster(0) as t:
    s = _store("ours")
    assert s.setup("localhost", t[1], 64 << 20, 16 << 20, "tcp", "", t[0]) == 0
    v = bytes(1024)
    for i in range(2 * N): assert s.put(f"k{i}", v) == 0
    for i in range(300): s.is_exist("k1")
    c0, w0 = time.process_time(), time.perf_counter()
    for i in range(N): assert s.is_exist(f"k{i}") == 1
    c1, w1 = time.process_time(), time.perf_counter()
    for i in range(N): assert s.remove(f"k{i}") == 0
    c2, w2 = time.process_time(), time.perf_counter()
    print(f"is_exist cpu {1e6*(c1-c0)/N:.1f} wall {1e6*(w1-w0)/N:.1f} | remove cpu {1e6*(c2-c1)/N:.1f} wall {1e6*(w2-w1)/N:.1f}")
    if len(sys.argv) > 1:
        pr = cProfile.Profile(); pr.enable()
        for i in range(N, 2 * N): s.remove(f"k{i}")
        pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(12)
    s.close()
