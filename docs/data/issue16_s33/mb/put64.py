import time, statistics, numpy as np
from pymooncake.bench.store_procs import _pymooncake_cluster
from pymooncake.store.client import StoreClient
from pymooncake.transfer import TransferConfig
MiB = 1 << 20
N = 2000
with _pymooncake_cluster(256 * MiB) as (addr, md, _):
    c = StoreClient(addr, md, global_segment_size=0, local_buffer_size=64 * MiB,
                    transfer_config=TransferConfig(transports=("local", "tcp"))).start()
    T = {}
    def wrap(obj, name):
        f = getattr(obj, name)
        def w(*a, **k):
            t = time.perf_counter()
            try: return f(*a, **k)
            finally: T.setdefault(name, []).append(time.perf_counter() - t)
        setattr(obj, name, w)
    wrap(c, "_master"); wrap(c._dp, "run")
    v = bytes(np.random.default_rng(0).integers(0, 256, 65536, dtype=np.uint8))
    c.put("warm", v)
    T.clear(); tot = []
    for i in range(N):
        t = time.perf_counter(); c.put(f"k{i}", v); tot.append(time.perf_counter() - t)
    print("put total p50 %.1f us" % (statistics.median(tot) * 1e6))
    for k, l in T.items():
        print(k, len(l), "p50 %.1f us" % (statistics.median(l) * 1e6))
    T.clear(); tot = []
    for i in range(N):
        t = time.perf_counter(); c.get(f"k{i}"); tot.append(time.perf_counter() - t)
    print("get total p50 %.1f us" % (statistics.median(tot) * 1e6))
    for k, l in T.items():
        print(k, len(l), "p50 %.1f us" % (statistics.median(l) * 1e6))
    c.close()
