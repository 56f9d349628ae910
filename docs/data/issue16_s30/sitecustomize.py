import os, sys, threading, json, time, atexit
if os.environ.get("PMK_RPC") and any(a in sys.argv for a in ("master", "conductor", "prefill", "decode")):
    role = next(a for a in ("master", "conductor", "prefill", "decode") if a in sys.argv)
    calls = {}
    def _wrap_clients():
        try:
            import pymooncake.rpc.async_client as ac, pymooncake.rpc.client as sc
        except Exception:
            return
        for mod, cls_name in ((ac, "RpcClient"), (sc, "SyncRpcClient")):
            cls = getattr(mod, cls_name, None)
            if cls is None: continue
            for meth in ("call", "notify"):
                f = getattr(cls, meth, None)
                if f is None: continue
                import inspect
                tag = f"{cls_name}.{meth}"
                if inspect.iscoroutinefunction(f):
                    async def w(self, method, *a, _f=f, _t=tag, **k):
                        calls[f"{_t}:{method}"] = calls.get(f"{_t}:{method}", 0) + 1
                        return await _f(self, method, *a, **k)
                else:
                    def w(self, method, *a, _f=f, _t=tag, **k):
                        calls[f"{_t}:{method}"] = calls.get(f"{_t}:{method}", 0) + 1
                        return _f(self, method, *a, **k)
                setattr(cls, meth, w)
    def _dump():
        done = False
        while True:
            time.sleep(1.0)
            if not done:
                _wrap_clients(); done = True
            try:
                import pymooncake.rpc.server as s
                srv = {f"{m}:{c}": ch.value for (m, c), ch in s._counters.items()}
            except Exception:
                srv = {}
            with open(f"/tmp/s30/rpc/{role}-{os.getpid()}.json", "w") as fh:
                json.dump({"server": srv, "client": calls}, fh)
    threading.Thread(target=_dump, daemon=True).start()
if os.environ.get("PMK_MASTERPROF") and "master" in sys.argv:
    import cProfile, time as _t, threading as _th
    _mpr = cProfile.Profile(_t.thread_time)
    _mpr.enable()
    def _mdump():
        while True:
            _t.sleep(3)
            _mpr.disable(); _mpr.dump_stats(f"/tmp/s30/mprof/master-{os.getpid()}.prof"); _mpr.enable()
    _th.Thread(target=_mdump, daemon=True).start()
