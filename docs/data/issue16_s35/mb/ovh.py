import time, statistics
from pymooncake.bench.transfer_subjects import Memcpy, Ours
from pymooncake.transfer.transports import cma
from pymooncake.transfer.batch import TransferOp
if __name__ == "__main__":
    o = Ours("cma", 4 << 20, 8, 2); mc = Memcpy(4 << 20, 8)
    peer = None
    desc = o.eng._resolve(o.writes[0].target_segment)
    pid = desc.pid
    def direct():
        t0 = time.perf_counter()
        for r in o.writes: cma.copy(pid, TransferOp.WRITE, r.local_addr, r.target_addr, r.length)
        t1 = time.perf_counter()
        for r in o.reads: cma.copy(pid, TransferOp.READ, r.local_addr, r.target_addr, r.length)
        return t1 - t0, time.perf_counter() - t1
    def sync():
        t0 = time.perf_counter(); o._sync(o.writes); t1 = time.perf_counter(); o._sync(o.reads)
        return t1 - t0, time.perf_counter() - t1
    subs = {"memcpy": mc.round, "engine_async": o.round, "engine_sync": sync, "direct": direct}
    res = {k: [] for k in subs}
    for i in range(150):
        for k, f in subs.items():
            w, r = f(); res[k].append(w + r)
    b = res["memcpy"]
    for k, v in res.items():
        rat = [x / y for x, y in zip(b, v)]
        q = statistics.quantiles(rat, n=4)
        print(f"{k:13s} {statistics.median(v)*1e3:7.3f} ms  vs memcpy {q[1]:.3f} [{q[0]:.3f}-{q[2]:.3f}]")
    o.close()
