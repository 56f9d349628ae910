import threading, time, os, sys, multiprocessing as mp
from pymooncake.bench import store_meta as sm, store_procs as sp
from pymooncake.bench import store as store_bench
def cpu(pid):
    s = open(f"/proc/{pid}/stat").read(); r = s[s.rfind(")") + 2:].split()
    return (int(r[11]) + int(r[12])) / os.sysconf("SC_CLK_TCK")
def main():
    clients, n, batch = 4, 10000, 16
    keys = [f"meta-key-{i}" for i in range(256)]
    with store_bench._pymooncake_cluster(0) as (addr, md, _):
        mpid = sp._HELPERS[0]
        holder = sm._store("ours"); holder.setup("localhost", md, 64 << 20, 16 << 20, "tcp", "", addr)
        for k in keys: holder.put(k, bytes(1024))
        samples = []; stop = threading.Event()
        ctx = mp.get_context("spawn"); barrier, q = ctx.Barrier(clients), ctx.Queue()
        procs = [ctx.Process(target=sm._worker, args=("ours", addr, md, w, n, batch, keys, barrier, q)) for w in range(clients)]
        for p in procs: p.start()
        pids = [p.pid for p in procs]
        def sampler():
            while not stop.is_set():
                try: samples.append((time.perf_counter(), cpu(mpid), sum(cpu(x) for x in pids)))
                except OSError: pass
                time.sleep(0.005)
        th = threading.Thread(target=sampler, daemon=True); th.start()
        res = [q.get(timeout=300) for _ in procs]
        for p in procs: p.join(30)
        stop.set(); holder.close()
    def cpu_at(t, i=1):
        best = min(samples, key=lambda s: abs(s[0] - t)); return best[i]
    for op in sm.OPS:
        per = [r[op] for _, r in res]
        t0 = min(p[0] for p in per); t1 = max(p[1] for p in per); ops = sum(p[2] for p in per)
        c = cpu_at(t1) - cpu_at(t0)
        calls = ops // (batch if op == "batch_is_exist" else 1)
        cc = cpu_at(t1, 2) - cpu_at(t0, 2)
        print(f"{op:15} {ops/(t1-t0):8.0f} ops/s  wall {t1-t0:.3f}s  master {c/(t1-t0):.2f} core, {1e6*c/calls:.1f} us/call; clients {cc/(t1-t0):.2f} cores, {1e6*cc/calls:.1f} us/call")
if __name__ == "__main__":
    main()
