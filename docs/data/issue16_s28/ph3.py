# ph3.py OPS: per phase, the master's utime/stime (ticks), voluntary/involuntary ctx
# switches, minor faults; clients' total utime/stime; ops/s.
import time, os, sys, subprocess, multiprocessing as mp
from pymooncake.bench import store_meta as sm, store_procs as sp
from pymooncake.bench import store as store_bench
def worker(ops, *a):
    sm.OPS = ops
    sm._worker(*a)
def pstat(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    st = {l.split(":")[0]: l.split(":")[1].strip() for l in open(f"/proc/{pid}/status")}
    return dict(minflt=int(f[7]), ut=int(f[11]), st=int(f[12]),
                vcs=int(st["voluntary_ctxt_switches"]), ivcs=int(st["nonvoluntary_ctxt_switches"]))
def tree(pid):
    # sum over threads
    tot = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            s = pstat(f"{pid}/task/{t}")
        except Exception:
            continue
        for k, v in s.items(): tot[k] = tot.get(k, 0) + v
    return tot
def main():
    if os.environ.get('MFLAGS'):
        sp.MASTER_FLAGS = (*sp.MASTER_FLAGS, *os.environ['MFLAGS'].split())
    ops = tuple(sys.argv[1].split(","))
    clients, n, batch = int(os.environ.get("CL", 4)), int(os.environ.get("N", 10000)), 16
    keys = [f"meta-key-{i}" for i in range(256)]
    with store_bench._pymooncake_cluster(0) as (addr, md, _):
        mpid = sp._HELPERS[0]
        holder = sm._store("ours"); holder.setup("localhost", md, 64 << 20, 16 << 20, "tcp", "", addr)
        for k in keys: holder.put(k, bytes(1024))
        ctx = mp.get_context("spawn"); barrier, q = ctx.Barrier(clients + 1), ctx.Queue()
        procs = [ctx.Process(target=worker, args=(ops, "ours", addr, md, w, n, batch, keys, barrier, q)) for w in range(clients)]
        for p in procs: p.start()
        snaps = []
        spy = os.environ.get("SPY")
        pr = None
        for op in ops:
            barrier.wait(120)
            snaps.append((tree(mpid), [tree(p.pid) for p in procs]))
            if pr: pr.send_signal(2); pr.wait(); pr = None
            if spy:
                pr = subprocess.Popen(["py-spy", "record", "-r", "2000", "--nonblocking", "-f", "raw", "-p", str(procs[0].pid if os.environ.get("SPYC") else mpid), "-o", f"{spy}_{op}.txt"], stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        barrier.wait(120)
        if pr: pr.send_signal(2); pr.wait(); pr = None
        snaps.append((tree(mpid), [tree(p.pid) for p in procs]))
        res = [q.get(timeout=300) for _ in procs]
        for p in procs: p.join(30)
        holder.close()
    for i, op in enumerate(ops):
        per = [r[op] for _, r in res]
        t0 = min(p[0] for p in per); t1 = max(p[1] for p in per); tot = sum(p[2] for p in per)
        m0, c0 = snaps[i]; m1, c1 = snaps[i + 1]
        dm = {k: m1[k] - m0[k] for k in m0}
        dc = {k: sum(b[k] - a[k] for a, b in zip(c0, c1)) for k in m0}
        us = lambda d: f"u {d['ut']*1e4/tot:.1f} s {d['st']*1e4/tot:.1f} µs/op vcs {d['vcs']/tot:.2f} ivcs {d['ivcs']/tot:.2f} flt {d['minflt']/tot:.2f}"
        print(f"{op:15} {tot/(t1-t0):8.0f} ops/s  master[{us(dm)}]  clients[{us(dc)}]")
if __name__ == "__main__":
    main()
