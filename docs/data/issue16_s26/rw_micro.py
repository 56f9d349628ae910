import time, numpy as np, sys
from pymooncake.transfer.batch import TransferOp
from pymooncake.transfer.memory import MemoryRegion, MemoryRegistry
from pymooncake.transfer.transports.base import Slice
from pymooncake.transfer.transports.tcp import open_connection, run_window
from pymooncake.transfer.transports.tcp_server import TcpDataServer
mem = np.zeros(1 << 20, dtype=np.uint8); reg = MemoryRegistry(); reg.add(MemoryRegion(mem.ctypes.data, mem.nbytes, mem))
srv = TcpDataServer("127.0.0.1", 0, reg)
conn = open_connection("127.0.0.1", srv.port, 2.0, 5.0)
src = np.ones(64 * 4096, dtype=np.uint8); v = memoryview(src)
for op in (TransferOp.WRITE, TransferOp.READ):
    sl = [Slice(op, src.ctypes.data + i * 4096, mem.ctypes.data + i * 4096, 4096, 1, i, view=v[i*4096:(i+1)*4096]) for i in range(64)]
    for _ in range(200): run_window(conn, sl, False, 1, 50e-6)
    best = []
    for rep in range(5):
        t0 = time.thread_time(); w0 = time.perf_counter()
        for _ in range(2000): run_window(conn, sl, False, 1, 50e-6)
        best.append(((time.thread_time() - t0) / 2000 / 64 * 1e6, (time.perf_counter() - w0) / 2000 / 64 * 1e6))
    best.sort()
    print(op.name, "per slice: cpu %.2f us wall %.2f us" % best[2])
conn.close(); srv.close()
