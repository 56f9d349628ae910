import os, sys, threading, time, json
if os.environ.get("PMK_ATT") and any(a in sys.argv for a in ("prefill", "decode", "worker")):
    st = {"n": 0, "cpu": 0, "wall": 0, "pairs": 0, "calls_rows": 0}
    def _patch():
        import pymooncake.engine.kernels as K
        import pymooncake.engine.model.attention as A
        orig = K.prefill_attention
        import torch
        mode = os.environ.get("PMK_ATT_MODE", "")
        bufs = {}
        def pa(q, layer_cache, blocks, ctx_len, scale, out):
            if mode == "copy":
                if "q" not in bufs:
                    bufs["q"] = torch.empty(2048 * q.stride(0)); bufs["o"] = torch.empty(2048 * 256)
                n_ = q.shape[0]
                qb = bufs["q"][: n_ * q.stride(0)].view(n_, q.stride(0))[:, : q.shape[1] * q.shape[2]].view(n_, q.shape[1], q.shape[2])
                qb.copy_(q); ob = bufs["o"][: out.numel()].view(out.shape)
            c0 = time.thread_time_ns(); w0 = time.perf_counter_ns()
            if mode == "copy":
                r = orig(qb, layer_cache, blocks, ctx_len, scale, ob); out.copy_(ob)
            else:
                r = orig(q, layer_cache, blocks, ctx_len, scale, out)
            st["cpu"] += time.thread_time_ns() - c0; st["wall"] += time.perf_counter_ns() - w0
            if "al" not in st:
                import ctypes
                libc = ctypes.CDLL(None); libc.malloc.restype = ctypes.c_void_p; libc.malloc.argtypes = [ctypes.c_size_t]; libc.free.argtypes = [ctypes.c_void_p]
                n_ = q.shape[0]; a1 = libc.malloc(4 * 4 * ctx_len); a2 = libc.malloc(4 * 4 * 32); libc.free(a2); libc.free(a1)
                st["al"] = {"scores": hex(a1), "acc": hex(a2), "q": hex(q.data_ptr()), "out": hex(out.data_ptr()), "cache": hex(layer_cache.data_ptr())}
            st["n"] += 1; (ctx_len == 448 and q.shape[0] == 448 and st.setdefault("bylayer", {}).setdefault(hex(layer_cache.data_ptr()), []).append(time.thread_time_ns() - c0)); (ctx_len == 448 and q.shape[0] == 448 and st.__setitem__("c448", st.get("c448", 0) + time.thread_time_ns() - c0) is None and st.__setitem__("n448", st.get("n448", 0) + 1)); st.setdefault("bl", []); (len(st["bl"]) < 400 and st["bl"].append([int(ctx_len), int(q.stride(0)), [int(x) for x in blocks[: -(-ctx_len // 16)].tolist()], hex(layer_cache.data_ptr()), hex(q.data_ptr())])); n = q.shape[0]; st["pairs"] += n * ctx_len - n * (n - 1) // 2
            return r
        K.prefill_attention = pa
        if getattr(A, "prefill_attention", None) is orig: A.prefill_attention = pa
    def _dump():
        time.sleep(3); 
        try: _patch()
        except Exception as e: st["err"] = repr(e)
        while True:
            time.sleep(1.0)
            with open(f"/tmp/s36/att/{os.getpid()}.json", "w") as fh:
                json.dump({"argv": sys.argv[-6:], **st}, fh)
    threading.Thread(target=_dump, daemon=True).start()
if os.environ.get("PMK_STEPS") and any(a in sys.argv for a in ("prefill", "decode", "worker")):
    import threading as _th, time as _t, json as _j
    _s = {"steps": 0, "rows": 0, "cpu_ns": 0, "hist": {}}
    def _patch_steps():
        from pymooncake.engine.engine import Engine
        from pymooncake.engine.runner import ModelRunner
        orig = Engine.step
        def step(self):
            c0 = _t.thread_time_ns()
            out = orig(self)
            _s["cpu_ns"] += _t.thread_time_ns() - c0
            return out
        Engine.step = step
        orig_ex = ModelRunner.execute
        def execute(self, out):
            n = len(out.scheduled)
            _s["steps"] += 1; _s["rows"] += n; k = str(min(n, 16)); _s["hist"][k] = _s["hist"].get(k, 0) + 1
            c0 = _t.thread_time_ns()
            try:
                return orig_ex(self, out)
            finally:
                _s["ex_ns"] = _s.get("ex_ns", 0) + _t.thread_time_ns() - c0
        ModelRunner.execute = execute
    _patch_steps()
    def _dump_steps():
        while True:
            _t.sleep(1.0)
            with open(f"/tmp/s36/steps/{os.getpid()}.json", "w") as fh:
                _j.dump({"argv": sys.argv[-6:], **_s}, fh)
    _th.Thread(target=_dump_steps, daemon=True).start()
