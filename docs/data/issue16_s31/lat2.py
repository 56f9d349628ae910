"""Wall µs per call, one client: is_exist, batch_is_exist (16 keys), get_size; client CPU too."""
import sys, time, cProfile, pstats
from pymooncake.bench import store_procs as sp
from pymooncake.bench.store_meta import _store
N = 6000
with sp._pymooncake_cluster(0) as t:
    s = _store("ours")
    assert s.setup("localhost", t[1], 64 << 20, 16 << 20, "tcp", "", t[0]) == 0
    keys = [f"meta-key-{i}" for i in range(256)]
    for k in keys: assert s.put(k, bytes(1024)) == 0
    groups = [[keys[(i * 16 + j) % 256] for j in range(16)] for i in range(N)]
    for _ in range(300): s.is_exist("meta-key-1")
    res = []
    for rnd in range(3):
        for name, f in (("ex", lambda i: s.is_exist(keys[i % 256])), ("bex", lambda i: s.batch_is_exist(groups[i])),
                        ("gs", lambda i: s.get_size(keys[i % 256]))):
            c0, w0 = time.process_time(), time.perf_counter()
            for i in range(N): f(i)
            res.append(f"{name}={1e6*(time.perf_counter()-w0)/N:.1f}/{1e6*(time.process_time()-c0)/N:.1f}")
    if len(sys.argv) > 1:
        pr = cProfile.Profile(); pr.enable()
        for i in range(N): s.batch_is_exist(groups[i])
        pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(12)
    s.close()
print(" ".join(res))
