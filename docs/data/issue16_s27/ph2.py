import threading, time, os, sys, subprocess, multiprocessing as mp
from pymooncake.bench import store_meta as sm, store_procs as sp
from pymooncake.bench import store as store_bench
def worker(ops, *a):
    sm.OPS = ops
    sm._worker(*a)
def main():
    ops = tuple(sys.argv[1].split(","))
    clients, n, batch = 4, int(os.environ.get("N", 10000)), 16
    keys = [f"meta-key-{i}" for i in range(256)]
    with store_bench._pymooncake_cluster(0) as (addr, md, _):
        mpid = sp._HELPERS[0]
        holder = sm._store("ours"); holder.setup("localhost", md, 64 << 20, 16 << 20, "tcp", "", addr)
        for k in keys: holder.put(k, bytes(1024))
        ctx = mp.get_context("spawn"); barrier, q = ctx.Barrier(clients + 1), ctx.Queue()
        procs = [ctx.Process(target=worker, args=(ops, "ours", addr, md, w, n, batch, keys, barrier, q)) for w in range(clients)]
        for p in procs: p.start()
        perf = None
        for op in ops:
            barrier.wait(120)
            if perf is None and len(sys.argv) > 2 and sys.argv[2]:
                perf = subprocess.Popen(["py-spy", "record", "-r", "500", "--nonblocking", "--gil", "-f", "raw", "-p", str(mpid), "-o", sys.argv[2]], stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        barrier.wait(120)
        if perf: perf.send_signal(2); perf.wait()
        res = [q.get(timeout=300) for _ in procs]
        for p in procs: p.join(30)
        holder.close()
    for op in ops:
        per = [r[op] for _, r in res]
        t0 = min(p[0] for p in per); t1 = max(p[1] for p in per); tot = sum(p[2] for p in per)
        print(f"{op:15} {tot/(t1-t0):8.0f} ops/s  wall {t1-t0:.3f}s")
if __name__ == "__main__":
    main()
