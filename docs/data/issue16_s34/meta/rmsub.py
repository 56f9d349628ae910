# ours only, 4 clients: remove phase in 8 sub-phases (is the second half slower?), then is_exist
import contextlib, sys
from pymooncake.bench import store_meta as sm
from pymooncake.bench import store_procs as sp
from pymooncake.bench.transfer_refs import tasks_cpu_s
MiB = 1 << 20
def main():
    keys = [f"meta-key-{i}" for i in range(256)]
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
    with contextlib.ExitStack() as st:
        addr, md = st.enter_context(sm._ours_cluster())
        master = sp._HELPERS[0]
        h = sm._store("ours"); st.callback(h.close)
        assert h.setup("localhost", md, 64 * MiB, 16 * MiB, "tcp", "", addr) == 0
        for k in keys: assert h.put(k, bytes(1024)) == 0
        d = sm._Clients("ours", addr, md, 4, n, 16, keys); st.callback(d.close)
        cl = [p.pid for p in d.procs]
        import os
        pin = os.environ.get("PIN", "")
        def tids(pid):
            return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        if pin == "split":   # master alone on CPU 0, clients on CPU 1
            for t in tids(master): os.sched_setaffinity(t, {0})
            for p in cl:
                for t in tids(p): os.sched_setaffinity(t, {1})
        elif pin == "master0":  # master on CPU 0, clients anywhere
            for t in tids(master): os.sched_setaffinity(t, {0})
        print("pin", pin or "none", flush=True)
        for op in ("is_exist", "remove", "is_exist"):
            b = [n * i // 8 for i in range(9)]
            out = []
            for lo, hi in zip(b, b[1:]):
                m0, c0 = tasks_cpu_s(master), sum(tasks_cpu_s(p) for p in cl)
                wall, done, ok = d.phase(op, lo, hi)
                m1, c1 = tasks_cpu_s(master), sum(tasks_cpu_s(p) for p in cl)
                out.append(f"{done / wall / 1000:5.1f}k m{(m1 - m0) / done * 1e6:4.1f} c{(c1 - c0) / done * 1e6:4.1f}")
            print(op, " | ".join(out), flush=True)
if __name__ == "__main__":
    main()
