import time, statistics, cProfile, pstats
from pymooncake.store.master.service import MasterService
from pymooncake.store.config import MasterConfig, ReplicateConfig
from pymooncake.store.protocol import ExistRequest, RemoveRequest
svc = MasterService(MasterConfig())
core = svc.core
core.mount_segment("c0", "seg0", "h0", 1 << 40, 256 << 20, 0.0)
N = 20000
def setup():
    keys = [f"meta-rm-{i}" for i in range(N)]
    for k in keys:
        core.put_start("c1", k, 1024, ReplicateConfig(), 1.0)
        core.put_end("c1", k, core.objects.get(k).generation, 2.0, None)
    return keys
res = {"exist": [], "removable": [], "finish": [], "after": []}
for r in range(5):
    keys = setup()
    t = time.perf_counter()
    for k in keys: svc._exist(ExistRequest("c1", k))
    res["exist"].append((time.perf_counter() - t) / N * 1e6)
    objs = []
    t = time.perf_counter()
    for k in keys: objs.append(core.removable(k, 5.0, False))
    res["removable"].append((time.perf_counter() - t) / N * 1e6)
    t = time.perf_counter()
    for o in objs: core.finish_remove(o)
    res["finish"].append((time.perf_counter() - t) / N * 1e6)
    t = time.perf_counter()
    for o in objs: svc._after()
    res["after"].append((time.perf_counter() - t) / N * 1e6)
print({k: round(statistics.median(v), 2) for k, v in res.items() if v})
keys = setup(); objs=[core.removable(k,5.0,False) for k in keys]
pr = cProfile.Profile(); pr.enable()
for o in objs: core.finish_remove(o)
pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(12)
