import time, gc
from pymooncake.store.config import MasterConfig, ReplicateConfig
from pymooncake.store.master.core import MasterCore
R1 = ReplicateConfig()
core = MasterCore(MasterConfig())
core.mount_segment("c0", "s0", "h0", 1 << 32, 256 << 20, 0.0)
for i in range(256):
    h = core.put_start("c0", f"meta-key-{i}", 1024, R1, 0.0); core.put_end("c0", f"meta-key-{i}", h.generation, 0.0, b"\x01" + bytes(8))
N = 40000
keys = [f"meta-rm-{i%4}-{i//4}" for i in range(N)]
for k in keys:
    h = core.put_start("c0", k, 1024, R1, 0.0); core.put_end("c0", k, h.generation, 0.0, b"\x01" + bytes(8))
def t(name, fn, ks):
    ks = [str(k) + "" for k in ks]
    t0 = time.perf_counter()
    for k in ks: fn(k)
    print(f"{name:12s} {1e6*(time.perf_counter()-t0)/len(ks):.2f} us")
t("exist", lambda k: core.exist("c1", k, 1.0), keys)
t("size", lambda k: core.size_of(k, 1.0, frozenset()), keys)
t("remove", lambda k: core.remove(k, 1.0), keys)
