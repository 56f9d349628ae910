import time, statistics
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
res = {"exist": [], "remove": [], "core_exist": [], "core_remove": []}
for r in range(5):
    keys = setup()
    reqs = [ExistRequest("c1", k) for k in keys]
    t = time.perf_counter()
    for q in reqs: svc._exist(q)
    res["exist"].append((time.perf_counter() - t) / N * 1e6)
    t = time.perf_counter()
    for k in keys: core.exist("c1", k, 5.0)
    res["core_exist"].append((time.perf_counter() - t) / N * 1e6)
    rq = [RemoveRequest("c1", k, False) for k in keys]
    t = time.perf_counter()
    for q in rq: svc._remove(q)
    res["remove"].append((time.perf_counter() - t) / N * 1e6)
print({k: round(statistics.median(v), 2) for k, v in res.items() if v})
