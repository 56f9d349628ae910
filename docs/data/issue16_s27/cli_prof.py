import cProfile, pstats, sys, time
from pymooncake.bench import store_meta as sm
from pymooncake.bench import store as store_bench
if __name__ == "__main__":
    with store_bench._pymooncake_cluster(0) as (addr, md, _):
        holder = sm._store("ours"); holder.setup("localhost", md, 64 << 20, 16 << 20, "tcp", "", addr)
        s = sm._store("ours"); s.setup("localhost", md, 0, 16 << 20, "tcp", "", addr)
        keys = [f"meta-rm-0-{i}" for i in range(5000)]
        v = bytes(1024)
        for k in keys: holder.put(k, v)
        for name, fn in (("is_exist", lambda: [s.is_exist(k) for k in keys]), ("remove", lambda: [s.remove(k) for k in keys])):
            t0 = time.perf_counter(); c0 = time.process_time()
            if name == sys.argv[1]:
                cProfile.runctx("fn()", globals(), locals(), "/tmp/s27/cli.prof")
            else:
                fn()
            print(name, f"{1e6*(time.perf_counter()-t0)/len(keys):.1f} us wall, {1e6*(time.process_time()-c0)/len(keys):.1f} us cpu per call")
        s.close(); holder.close()
    pstats.Stats("/tmp/s27/cli.prof").sort_stats("tottime").print_stats(14)
