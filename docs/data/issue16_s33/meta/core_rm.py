# MasterCore in-process: exist vs removable+finish_remove per object (20k objects of 1 KiB)
import time
from pymooncake.store.master.core import MasterCore
from pymooncake.store.config import MasterConfig, ReplicateConfig
def run(n=20000):
    core = MasterCore(MasterConfig())
    core.mount_segment("c0", "seg0", "h0", 1 << 40, 256 << 20, 0.0)
    cfg = ReplicateConfig()
    keys = [f"meta-rm-{i % 4}-{i}" for i in range(n)]
    for k in keys:
        core.put_start("c1", k, 1024, cfg, 1.0)
        core.put_end("c1", k, core.objects.get(k).generation, 2.0, None)
    t0 = time.thread_time()
    for k in keys: core.exist("c1", k, 3.0)
    t1 = time.thread_time()
    for k in keys: core.removable(k, 4.0)
    t2 = time.thread_time()
    objs = [core.objects.get(k) for k in keys]
    t3 = time.thread_time()
    for o in objs: core.finish_remove(o)
    t4 = time.thread_time()
    return [(t1-t0)/n*1e6, (t2-t1)/n*1e6, (t4-t3)/n*1e6]
rs = [run() for _ in range(5)]
import statistics
print("exist / removable / finish_remove us (median of 5):", [round(statistics.median(r[i] for r in rs), 2) for i in range(3)])
