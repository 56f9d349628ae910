# main-thread CPU of sending one TokenFrames notice per "engine step": a task per notice
# (notify coroutine, before) vs notify_now (after); the receiving server in another process
import asyncio, subprocess, sys, threading, time, os
from pymooncake.rpc import RpcClient
from pymooncake.rpc.messages import TokenFrame, TokenFrames
srv = subprocess.Popen([sys.executable, "-c", """
import asyncio
from pymooncake.rpc import RpcServer
async def main():
    s = RpcServer('127.0.0.1', 0); s.register('tokens', lambda p: None); s.register('echo', lambda p: p)
    await s.start(); print(s.port, flush=True); await asyncio.Event().wait()
asyncio.run(main())
"""], stdout=subprocess.PIPE, text=True)
port = int(srv.stdout.readline())
N = 3000
async def main(mode):
    c = RpcClient("127.0.0.1", port); await c.call("echo", 1)
    loop = asyncio.get_running_loop(); done = asyncio.Event()
    seq = [0]
    def push():
        f = TokenFrames("decode-0", (TokenFrame(f"req-{seq[0] % 3}", seq[0], (17,), None, None, None, ()),))
        seq[0] += 1
        if mode == "task":
            asyncio.ensure_future(c.notify("tokens", f))
        else:
            c.notify_now("tokens", f)
        if seq[0] == N: done.set()
    def engine():
        for _ in range(N):
            time.sleep(0.0005); loop.call_soon_threadsafe(push)
    t0 = time.thread_time()
    th = threading.Thread(target=engine); th.start()
    await done.wait(); await c.call("echo", 1)
    cpu = time.thread_time() - t0
    th.join(); await c.close()
    return cpu / N * 1e6
res = {"task": [], "now": []}
for r in range(5):
    for m in ("task", "now"):
        res[m].append(asyncio.run(main(m)))
srv.kill()
for m, v in res.items():
    v.sort(); print(m, "median us/notice (loop thread CPU incl. wake-up):", round(v[2], 1), [round(x, 1) for x in v])
