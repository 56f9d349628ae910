# MasterCore batch put cost per object, in-process (the handler's per-key core calls only)
import time, sys
from pymooncake.store.master.core import MasterCore
from pymooncake.store.config import MasterConfig, ReplicateConfig
from pymooncake.store.checksum import digests
def run(n=7530, size=131072):
    core = MasterCore(MasterConfig())
    core.mount_segment("c0", "seg0", "h0", 1 << 40, 512 << 20, 0.0)
    core.mount_segment("c1", "seg1", "h1", 2 << 40, 512 << 20, 0.0)
    cfg = ReplicateConfig()
    keys = [f"ns0:blk:{i:064x}" for i in range(n)]
    import os
    sums = None
    t0 = time.thread_time()
    for lo in range(0, n, 90):
        for k in keys[lo:lo + 90]:
            core.put_start("c0", k, size, cfg, 1.0)
    t1 = time.thread_time()
    for lo in range(0, n, 90):
        for k in keys[lo:lo + 90]:
            core.put_end("c0", k, core.objects.get(k).generation, 2.0, None)
    t2 = time.thread_time()
    return (t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6
r = sorted(run() for _ in range(5))
print("put_start / put_end us per object (median of 5):", [round(x, 2) for x in r[2]])
