import time, sys, os, multiprocessing as mp
from pymooncake.bench import store_meta as sm
from pymooncake.bench import store as store_bench
MiB = 1 << 20
def worker(addr, md, wid, n, keys, order, barrier, q, ev):
    if os.environ.get("CPOLL") is not None:
        from pymooncake.rpc.client import SyncRpcClient
        d = list(SyncRpcClient.__init__.__defaults__); d[-1] = float(os.environ["CPOLL"])
        SyncRpcClient.__init__.__defaults__ = tuple(d)
    s = sm._store("ours")
    s.setup("localhost", md, 0, 16 * MiB, "tcp", "", addr)
    mine = [f"meta-rm-{wid}-{i}" for i in range(n)]
    for k in mine: assert s.put(k, bytes(1024)) == 0
    out = {}
    for op in order:
        barrier.wait(120)
        if wid == 0: ev.set()
        t0 = time.perf_counter()
        if op == "is_exist":
            for i in range(n): s.is_exist(keys[i % len(keys)])
        elif op == "exist_mine":
            lat = []
            pc = time.perf_counter
            for k in mine:
                a = pc(); s.is_exist(k); lat.append(pc() - a)
        elif op == "remove":
            lat = []
            pc = time.perf_counter
            for k in mine:
                a = pc(); s.remove(k); lat.append(pc() - a)
        out[op] = (t0, time.perf_counter(), n)
        if op != "is_exist":
            lat.sort(); L = len(lat)
            out[op + "_lat"] = [round(1e6 * lat[int(L * f)], 1) for f in (0.1, 0.5, 0.9, 0.99, 0.999)] + [round(1e6 * lat[-1]), round(1e3 * sum(x for x in lat if x > 200e-6), 1)]
    barrier.wait(120)
    q.put(out)
    s.close()
def main(order):
    clients, n = 4, int(os.environ.get("N", "10000"))
    keys = [f"meta-key-{i}" for i in range(256)]
    from pymooncake.bench import store_procs as sp0
    if os.environ.get("MPOLL") is not None:
        sp0.MASTER_FLAGS = [*sp0.MASTER_FLAGS, "--rpc-poll", os.environ["MPOLL"]]
    with store_bench._pymooncake_cluster(0) as (addr, md, _):
        holder = sm._store("ours"); holder.setup("localhost", md, 64 << 20, 16 << 20, "tcp", "", addr)
        for k in keys: holder.put(k, bytes(1024))
        ctx = mp.get_context("spawn"); barrier, q, ev = ctx.Barrier(clients), ctx.Queue(), ctx.Event()
        procs = [ctx.Process(target=worker, args=(addr, md, w, n, keys, order, barrier, q, ev)) for w in range(clients)]
        for p in procs: p.start()
        import threading
        from pymooncake.bench import store_procs as sp
        mpid = sp._HELPERS[0]
        if os.environ.get("PROF"):
            import signal
            ev.wait(120); time.sleep(0.05)
            os.kill(mpid, signal.SIGUSR1); time.sleep(0.4); os.kill(mpid, signal.SIGUSR2)
        if os.environ.get("STRACE"):
            ev.wait(120)
            import subprocess
            subprocess.Popen(["timeout", "-s", "INT", "1.5", "strace", "-c", "-f", "-p", str(mpid), "-o", os.environ["STRACE"]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if os.environ.get("SPY"):
            ev.wait(120)
            import subprocess
            spy = subprocess.Popen(["/work/main/.venv/bin/py-spy", "record", "--pid", str(mpid), "-r", "2000", "-f", "raw", "-o", os.environ["SPY"], "-d", os.environ.get("SPY_D", "4"), "--nonblocking"] + (["--native"] if os.environ.get("NATIVE") else []) + (["--threads"] if os.environ.get("THREADS") else []), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        def cpu(pid):
            x = open(f"/proc/{pid}/stat").read(); r = x[x.rfind(")") + 2:].split()
            return (int(r[11]) + int(r[12])) / os.sysconf("SC_CLK_TCK")
        def ustat(pid):
            x = open(f"/proc/{pid}/stat").read(); r = x[x.rfind(")") + 2:].split()
            return int(r[11]), int(r[12]), int(r[7])
        samples = []; stop = threading.Event()
        pids = [p.pid for p in procs]
        def sampler():
            while not stop.is_set():
                try: samples.append((time.perf_counter(), cpu(mpid), sum(cpu(x) for x in pids), ustat(mpid), [ustat(x) for x in pids]))
                except OSError: pass
                time.sleep(0.005)
        th = threading.Thread(target=sampler, daemon=True); th.start()
        res = [q.get(timeout=300) for _ in procs]
        stop.set()
        for p in procs: p.join(30)
        holder.close()
    line = []
    for op in order:
        per = [r[op] for r in res]
        t0 = min(p[0] for p in per); t1 = max(p[1] for p in per)
        skew = max(p[0] for p in per) - t0; tail = t1 - min(p[1] for p in per)
        at = lambda t, i: min(samples, key=lambda x: abs(x[0] - t))[i]
        mc = at(t1, 1) - at(t0, 1); cc = at(t1, 2) - at(t0, 2); calls = clients * n
        u0, u1 = at(t0, 3), at(t1, 3); cu0, cu1 = at(t0, 4), at(t1, 4)
        print(op, "master utime/stime/minflt", [b - a for a, b in zip(u0, u1)], "clients", [[b - a for a, b in zip(x, y)] for x, y in zip(cu0, cu1)])
        line.append(f"{op} {calls/(t1-t0)/1e3:.1f}k master {1e6*mc/calls:.1f} us/call ({mc/(t1-t0):.2f} core) clients {1e6*cc/calls:.1f} us/call ({cc/(t1-t0):.2f})")
    print(" | ".join(line))
    for r in res:
        print({k: v for k, v in r.items() if k.endswith("_lat")})
if __name__ == "__main__":
    import os
    if os.environ.get("ORDER"):
        main(os.environ["ORDER"].split(",")); raise SystemExit
    for r in range(2):
        main(["is_exist", "exist_mine", "remove"])
        main(["remove", "is_exist"])
