# ours only, 4 clients: per phase, the master's and the clients' CPU per operation
import contextlib, time
from pymooncake.bench import store_meta as sm, store as sb
from pymooncake.bench import store_procs as sp
from pymooncake.bench.transfer_refs import tasks_cpu_s
if __name__ == "__main__":
    keys = [f"meta-key-{i}" for i in range(256)]
    n = 5000
    for rnd in range(3):
        with contextlib.ExitStack() as st:
            addr, md = st.enter_context(sm._ours_cluster())
            master = sp._HELPERS[0]
            h = sm._store("ours"); st.callback(h.close)
            assert h.setup("localhost", md, 64 << 20, 16 << 20, "tcp", "", addr) == 0
            for k in keys: assert h.put(k, bytes(1024)) == 0
            d = sm._Clients("ours", addr, md, 4, n, 16, keys); st.callback(d.close)
            cl = [p.pid for p in d.procs]
            for op in ("is_exist", "get_size", "remove"):
                m0, c0 = tasks_cpu_s(master), sum(tasks_cpu_s(p) for p in cl)
                wall, done, ok = d.phase(op, 0, n)
                m1, c1 = tasks_cpu_s(master), sum(tasks_cpu_s(p) for p in cl)
                print(f"round {rnd} {op:9s} {done / wall:8.0f}/s  master {(m1 - m0) / done * 1e6:5.1f} us/op  clients {(c1 - c0) / done * 1e6:5.1f} us/op  ok={ok}", flush=True)
