# per sub-phase CPU of every process of both sides (is the idle side quiet during the other's remove?)
import contextlib, sys, time, os
sys.path.append("/tmp/mcvenv/lib/python3.11/site-packages")
from pymooncake.bench import store_meta as sm, store as sb
from pymooncake.bench import store_procs as sp
from pymooncake.bench.transfer_refs import tasks_cpu_s
MiB = 1 << 20
def main():
    keys = [f"meta-key-{i}" for i in range(256)]
    n = 5000
    sides = sys.argv[1].split(",")
    with contextlib.ExitStack() as st:
        drv, pids = {}, {}
        for side in sides:
            addr, md = st.enter_context(sb._mooncake_cluster() if side == "mooncake" else sm._ours_cluster())
            master = sp._HELPERS[0]
            h = sm._store(side); st.callback(h.close)
            assert h.setup("localhost", md, 64 * MiB, 16 * MiB, "tcp", "", addr) == 0
            for k in keys: assert h.put(k, bytes(1024)) == 0
            d = sm._Clients(side, addr, md, 4, n, 16, keys); st.callback(d.close)
            drv[side] = d
            pids[side] = (master, [p.pid for p in d.procs])
        me = os.getpid()
        def snap():
            out = {"parent": tasks_cpu_s(me)}
            for s, (m, cl) in pids.items():
                out[s + ".master"] = tasks_cpu_s(m)
                out[s + ".clients"] = sum(tasks_cpu_s(p) for p in cl)
            return out
        bounds = [n * i // 4 for i in range(5)]
        for op in sm.OPS:
            for k, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
                order = sides if k % 2 == 0 else sides[::-1]
                for s in order:
                    a = snap(); wall, done, ok = drv[s].phase(op, lo, hi); b = snap()
                    cpu = {x: (b[x] - a[x]) / done * 1e6 for x in a}
                    print(f"{op:15s} {k} {s:8s} {done / wall:8.0f}/s wall {wall*1e3:6.1f}ms  " +
                          " ".join(f"{x}={v:5.1f}" for x, v in cpu.items()), flush=True)
if __name__ == "__main__":
    main()
