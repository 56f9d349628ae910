import time, socket, os
from pymooncake.bench import store_procs as sp
from pymooncake.bench.store_meta import _store
from pymooncake.store.protocol import ExistRequest
from pymooncake.rpc.codec import pack_frame
N = 20000
def meas(name, fn):
    for i in range(500): fn(i)
    c0, w0 = time.thread_time(), time.perf_counter()
    for i in range(N): fn(i)
    c1, w1 = time.thread_time(), time.perf_counter()
    print(f"{name:10s} cpu {1e6*(c1-c0)/N:5.1f} wall {1e6*(w1-w0)/N:5.1f} us")
if __name__ == "__main__":
  with sp._pymooncake_cluster(0) as t:
    s = _store("ours")
    assert s.setup("localhost", t[1], 64 << 20, 16 << 20, "tcp", "", t[0]) == 0
    v = bytes(1024)
    keys = [f"meta-key-{i}" for i in range(256)]
    for k in keys: assert s.put(k, v) == 0
    c = s.client
    rpc = c._rpc
    cid = c.client_id
    req = ExistRequest(cid, keys[0], ())
    sync = rpc._rpc
    for rnd in range(2):
        meas("compat", lambda i: s.is_exist(keys[i & 255]))
        meas("client", lambda i: c.exist(keys[i & 255]))
        meas("_master", lambda i: c._master("exist", ExistRequest(cid, keys[i & 255], ())))
        meas("leader", lambda i: rpc.call("exist", req))
        meas("sync", lambda i: sync.call("exist", req))
        frame = pack_frame({"i": 1, "m": "exist", "p": req})
        sock = sync._sock
        def raw(i):
            sock.sendall(frame)
            while True:
                try:
                    return sock.recv(65536, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    os.sched_yield()
        meas("raw-spin", raw)
        def rawb(i):
            sock.sendall(frame)
            return sock.recv(65536)
        meas("raw-block", rawb)
    s.close()
