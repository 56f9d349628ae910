import subprocess, sys, threading, time, os
sys.path.insert(0, "/tmp/s27/new/src")
from pymooncake.rpc import client as rc
from pymooncake.rpc import SyncRpcClient
SERVER = """
import asyncio, uvloop
from pymooncake.rpc import RpcServer
async def main():
    s = RpcServer("127.0.0.1", 0)
    async def slow(p):
        await asyncio.sleep(p)
        return 1
    s.register("slow", slow)
    s.register("fast", lambda p: 1)
    await s.start(); print(s.port, flush=True); await s.serve_forever()
uvloop.run(main())
"""
proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH="/tmp/s27/new/src"))
port = int(proc.stdout.readline())
def run(cap, method, arg):
    rc.REPLY_POLL_MAX_S = cap
    c = SyncRpcClient("127.0.0.1", port)
    stop = threading.Event(); calls = [0]
    def caller():
        while not stop.is_set():
            c.call(method, arg); calls[0] += 1
            time.sleep(0.002)
    th = threading.Thread(target=caller); th.start()
    n = 0; t0 = time.process_time(); w0 = time.perf_counter()
    while time.perf_counter() - w0 < 3:
        for i in range(1000): n += i * i
    stop.set(); th.join()
    print(f"cap {cap*1e6:.0f}us {method}: engine loops {n/1e6:.1f}M in 3 s, calls {calls[0]}, proc cpu {time.process_time()-t0:.2f}s rtt {c.rtt_s*1e6:.0f}us")
for _ in range(2):
    for cap in (0.0, 300e-6):
        run(cap, "fast", None)
proc.kill()
