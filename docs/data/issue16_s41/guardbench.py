import asyncio, time, sys, importlib.util
def load(path):
    spec = importlib.util.spec_from_file_location("wl", path); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
async def rpc(loop):   # a coroutine call answered on a later loop turn, like RpcClient.call
    f = loop.create_future(); loop.call_soon(f.set_result, 1); return await f
async def main(mod, n, rid="r"):
    """CPU per call of a coroutine call and of a future call through guard(rid, ...), in us;
    rid "r" is watched (the guarded path), "u" is not (the call's own cost)."""
    loop = asyncio.get_running_loop(); w = mod.WorkerLossWatch(); w.watch("r", ("a", "b"))
    t0 = time.process_time()
    for _ in range(n):
        await w.guard(rid, rpc(loop))
        f = asyncio.ensure_future(rpc(loop)); await w.guard(rid, f)
    return (time.process_time() - t0) / (2 * n) * 1e6
for path in sys.argv[1:]:
    m = load(path)
    print(path, "guarded", [round(asyncio.run(main(m, 20000)), 1) for _ in range(3)],
          "unguarded", [round(asyncio.run(main(m, 20000, "u")), 1) for _ in range(3)], "us CPU a call")
