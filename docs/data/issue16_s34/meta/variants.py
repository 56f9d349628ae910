# ours only: client poll variants at depth N, alternating sub-phases on one cluster
import contextlib, sys, time, os, json
import multiprocessing as mp
from pymooncake.bench import store_meta as sm
from pymooncake.bench import store_procs as sp
from pymooncake.bench.transfer_refs import tasks_cpu_s
MiB = 1 << 20
VARIANTS = {"cur": None, "tcp": "tcp", "nopoll": (0.0, None), "flat50": (50e-6, 0.0), "cap100": (50e-6, 100e-6)}

def vworker(variant, side, addr, md, wid, n, batch, keys, barrier, cmds, q):
    import pymooncake.rpc.client as rc
    v = VARIANTS[variant]
    if v == "tcp":
        os.environ["PYMOONCAKE_RPC_UNIX"] = "0"
    elif v is not None:
        poll, cap = v
        rc.SyncRpcClient.__init__.__defaults__ = (5.0, poll)
        if cap is not None:
            rc.REPLY_POLL_MAX_S = cap
    sm._worker(side, addr, md, wid, n, batch, keys, barrier, cmds, q)

class Group(sm._Clients):
    def __init__(self, variant, addr, md, clients, n, batch, keys, base):
        ctx = mp.get_context("spawn")
        self.side, self.q = variant, ctx.Queue()
        barrier = ctx.Barrier(clients)
        self.cmds = [ctx.Queue() for _ in range(clients)]
        self.procs = [ctx.Process(target=vworker, args=(variant, "ours", addr, md, base + w, n, batch, keys, barrier, self.cmds[w], self.q)) for w in range(clients)]
        for p in self.procs: p.start()
        self._collect()

def main():
    clients, sub, names = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
    keys = [f"meta-key-{i}" for i in range(256)]
    n = int(os.environ.get("N", "3000"))
    with contextlib.ExitStack() as st:
        addr, md = st.enter_context(sm._ours_cluster())
        master = sp._HELPERS[0]
        h = sm._store("ours"); st.callback(h.close)
        assert h.setup("localhost", md, 512 * MiB, 16 * MiB, "tcp", "", addr) == 0
        for k in keys: assert h.put(k, bytes(1024)) == 0
        groups = []
        for g, v in enumerate(names):
            d = Group(v, addr, md, clients, n, 16, keys, 100 * g); st.callback(d.close); groups.append(d)
        res = {v: {op: [] for op in sm.OPS} for v in names}
        bounds = [n * i // sub for i in range(sub + 1)]
        for op in sm.OPS:
            for k, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
                order = groups if k % 2 == 0 else groups[::-1]
                for d in order:
                    cl = [p.pid for p in d.procs]
                    m0, c0 = tasks_cpu_s(master), sum(tasks_cpu_s(p) for p in cl)
                    wall, done, ok = d.phase(op, lo, hi)
                    m1, c1 = tasks_cpu_s(master), sum(tasks_cpu_s(p) for p in cl)
                    assert ok
                    res[d.side][op].append((done / wall, (m1 - m0) / done * 1e6, (c1 - c0) / done * 1e6))
        import statistics as S
        for op in sm.OPS:
            for v in names:
                r = res[v][op]
                print(f"{clients} {op:15s} {v:7s} ops/s {S.median(x[0] for x in r):8.0f}  master {S.median(x[1] for x in r):5.1f}  clients {S.median(x[2] for x in r):5.1f} us/op   per-sub {[round(x[0]/1000,1) for x in r]}", flush=True)

if __name__ == "__main__":
    main()
