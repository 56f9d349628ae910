import sys, time, os, subprocess
from pymooncake.bench import store_procs as sp
from pymooncake.store.compat import MooncakeDistributedStore
N = 40000; MiB = 1 << 20
sp.MASTER_FLAGS = [*sp.MASTER_FLAGS, "--rpc-poll", "0"]
with sp._pymooncake_cluster(0) as (addr, md, _):
    pid = sp._HELPERS[0]
    h = MooncakeDistributedStore(); assert h.setup("localhost", md, 256 * MiB, 16 * MiB, "tcp", "", addr) == 0
    c = MooncakeDistributedStore(); assert c.setup("localhost", md, 0, 16 * MiB, "tcp", "", addr) == 0
    keys = [f"k-{i}" for i in range(256)]
    for k in keys: assert h.put(k, bytes(1024)) == 0
    mine = [f"rm-{i}" for i in range(N)]
    for k in mine: assert c.put(k, bytes(1024)) == 0
    for op in ("exist", "remove"):
        spy = subprocess.Popen(["/work/main/.venv/bin/py-spy", "record", "-r", "1000", "-f", "raw", "-o", f"/tmp/s33/meta/spy_{op}.txt", "-p", str(pid), "--nonblocking", "--native"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        t = time.perf_counter()
        if op == "exist":
            for k in mine: c.is_exist(k)
        else:
            for k in mine: assert c.remove(k) == 0
        print(op, (time.perf_counter() - t) / N * 1e6, "us/op", flush=True)
        spy.send_signal(2); spy.wait()
    c.close(); h.close()
