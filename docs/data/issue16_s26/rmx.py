import time
from pymooncake.bench import store_procs as sp
from pymooncake.bench.store_meta import _store
N = 20000
def meas(name, fn, keys):
    c0, w0 = time.thread_time(), time.perf_counter()
    for k in keys: fn(k)
    c1, w1 = time.thread_time(), time.perf_counter()
    print(f"{name:22s} cpu {1e6*(c1-c0)/len(keys):5.1f} wall {1e6*(w1-w0)/len(keys):5.1f} us")
if __name__ == "__main__":
  with sp._pymooncake_cluster(0) as t:
    s = _store("ours")
    assert s.setup("localhost", t[1], 64 << 20, 16 << 20, "tcp", "", t[0]) == 0
    v = bytes(1024)
    hot = [f"meta-key-{i}" for i in range(256)]
    for k in hot: assert s.put(k, v) == 0
    mine = [f"meta-rm-0-{i}" for i in range(N)]
    for k in mine: assert s.put(k, v) == 0
    meas("is_exist hot", lambda k: s.is_exist(k), [hot[i & 255] for i in range(N)])
    meas("is_exist distinct", lambda k: s.is_exist(k), mine)
    meas("get_size distinct", lambda k: s.get_size(k), mine)
    meas("is_exist hot", lambda k: s.is_exist(k), [hot[i & 255] for i in range(N)])
    meas("remove distinct", lambda k: s.remove(k), mine)
    meas("is_exist missing", lambda k: s.is_exist(k), mine)
    meas("remove missing", lambda k: s.remove(k), mine[:5000])
    s.close()
