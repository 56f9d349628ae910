# ph2.py OPS [PYSPY_OUT]: the metadata harness's phases OPS (comma-separated), 4 clients x N
# calls (env N, default 10,000) against our master; ops/s per phase. With PYSPY_OUT, py-spy
# --gil records the master over the phases. run() is shared with session 28's ph3.py.
import os, sys, subprocess, multiprocessing as mp
from pymooncake.bench import store_meta as sm, store_procs as sp
from pymooncake.bench import store as store_bench
def worker(ops, *a):
    sm.OPS = ops
    sm._worker(*a)
def run(ops, clients, n, at_barrier=lambda i, mpid, procs: None):
    """One cluster, ``clients`` processes running ``ops``; ``at_barrier(i, master pid,
    processes)`` after the barrier that starts phase i (i == len(ops): all done). Returns
    {op: (ops/s, wall s)}."""
    batch = 16
    keys = [f"meta-key-{i}" for i in range(256)]
    with store_bench._pymooncake_cluster(0) as (addr, md, _):
        mpid = sp._HELPERS[0]
        holder = sm._store("ours"); holder.setup("localhost", md, 64 << 20, 16 << 20, "tcp", "", addr)
        for k in keys: holder.put(k, bytes(1024))
        ctx = mp.get_context("spawn"); barrier, q = ctx.Barrier(clients + 1), ctx.Queue()
        procs = [ctx.Process(target=worker, args=(ops, "ours", addr, md, w, n, batch, keys, barrier, q)) for w in range(clients)]
        for p in procs: p.start()
        for i in range(len(ops) + 1):
            barrier.wait(120)
            at_barrier(i, mpid, procs)
        res = [q.get(timeout=300) for _ in procs]
        for p in procs: p.join(30)
        holder.close()
    out = {}
    for op in ops:
        per = [r[op] for _, r in res]
        t0 = min(p[0] for p in per); t1 = max(p[1] for p in per); tot = sum(p[2] for p in per)
        out[op] = (tot / (t1 - t0), t1 - t0)
    return out
def main():
    ops = tuple(sys.argv[1].split(","))
    perf = []
    def spy(i, mpid, procs):
        if i == 0 and len(sys.argv) > 2 and sys.argv[2]:
            perf.append(subprocess.Popen(["py-spy", "record", "-r", "500", "--nonblocking", "--gil", "-f", "raw", "-p", str(mpid), "-o", sys.argv[2]], stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
        if i == len(ops):
            for p in perf: p.send_signal(2); p.wait()
    for op, (rate, wall) in run(ops, 4, int(os.environ.get("N", 10000)), spy).items():
        print(f"{op:15} {rate:8.0f} ops/s  wall {wall:.3f}s")
if __name__ == "__main__":
    main()
