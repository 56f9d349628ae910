"""Loaded into every cluster process by PMK_STEPS=1 PYTHONPATH=<this folder>: counts RPCs
served, times engine steps / model execution / DecodeLayers calls / a few engine functions
with thread CPU time, and reads per-thread CPU from /proc; dumps it all to
/tmp/s37/steps/PID.json once a second."""
import os, sys
ROLES = ("prefill", "decode", "worker", "conductor", "master")
if os.environ.get("PMK_STEPS") and any(a in sys.argv for a in ROLES):
    import json, threading, time
    now = time.thread_time_ns
    S = {"steps": 0, "rows": 0, "cpu_ns": 0, "ex_ns": 0, "dl_ns": 0, "dl_rows": {}, "hist": {},
         "thr": {}, "fn": {}, "rpc": {}}

    def timed(cls, name, done):
        """Replace cls.name by a wrapper that calls done(args, thread CPU ns)."""
        inner = getattr(cls, name)
        def wrapper(*a, **k):
            c0 = now()
            try:
                return inner(*a, **k)
            finally:
                done(a, now() - c0)
        setattr(cls, name, wrapper)

    def add(d, key, v):
        d[key] = d.get(key, 0) + v

    def patch_rpc():
        import pymooncake.rpc.server as rs
        inner = rs.RpcServer._finish
        def finish(self, method, *a, **k):
            add(S["rpc"], method.name, 1)
            return inner(self, method, *a, **k)
        rs.RpcServer._finish = finish

    def on_execute(a, ns):
        out = a[1]
        n = len(out.scheduled)
        S["steps"] += 1; S["rows"] += n; S["ex_ns"] += ns
        add(S["hist"], str(min(n, 16)), 1)
        if n and any(sc.num_new_tokens > 1 for sc in out.scheduled):
            # a prefill-carrying step: (new tokens, tokens before) per sequence. The
            # scheduler updates num_computed_tokens after execute, so these are the starts.
            S.setdefault("pf", []).append(
                [[(sc.num_new_tokens, sc.request.num_computed_tokens) for sc in out.scheduled],
                 ns, time.time()])

    def on_layers(a, ns):
        S["dl_ns"] += ns
        e = S["dl_rows"].setdefault(str(a[0].rows), [0, 0]); e[0] += 1; e[1] += ns

    def patch_engine():
        from pymooncake.engine.engine import Engine
        from pymooncake.engine.kernels.decode_layers import DecodeLayers
        from pymooncake.engine.model import fused
        from pymooncake.engine.model.llama import LlamaForCausalLM
        from pymooncake.engine.runner import ModelRunner
        from pymooncake.engine.scheduler import Scheduler
        from pymooncake.engine.kv_receiver import KVReceiver
        from pymooncake.engine.worker.decode import DecodeWorker
        timed(Engine, "step", lambda a, ns: S.__setitem__("cpu_ns", S["cpu_ns"] + ns))
        timed(ModelRunner, "execute", on_execute)
        timed(DecodeLayers, "run", on_layers)
        for cls, name, key in ((ModelRunner, "prepare", "prepare"),
                               (LlamaForCausalLM, "forward", "forward"),
                               (LlamaForCausalLM, "compute_logits", "logits"),
                               (Scheduler, "schedule", "schedule"),
                               (Scheduler, "update_from_output", "update"),
                               (KVReceiver, "start_step", "recv.start_step"),
                               (KVReceiver, "before_layer", "recv.before_layer"),
                               (KVReceiver, "after_layer", "recv.after_layer"),
                               (KVReceiver, "end_step", "recv.end_step"),
                               (DecodeWorker, "after_step", "dw.after_step"),
                               (DecodeLayers, "set_step", "set_step"),
                               (fused, "rope_tables", "rope_tables")):
            timed(cls, name, lambda a, ns, key=key: add(S["fn"], key, ns))

    try:
        patch_rpc()
    except Exception as e:  # noqa: BLE001 - a measurement aid: keep serving
        S["rpc_err"] = repr(e)
    if any(a in sys.argv for a in ("prefill", "decode", "worker")):
        patch_engine()

    def dump():
        tick = os.sysconf("SC_CLK_TCK")
        while True:
            time.sleep(1.0)
            names = {t.native_id: t.name for t in threading.enumerate()}
            thr = {}
            for tid in os.listdir("/proc/self/task"):
                try:
                    comm = open(f"/proc/self/task/{tid}/comm").read().strip()
                    f = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
                    thr[names.get(int(tid), f"{comm}:{tid}")] = (int(f[11]) + int(f[12])) / tick
                except (OSError, ValueError, IndexError):
                    pass
            S["thr"] = thr
            with open(f"/tmp/s37/steps/{os.getpid()}.json", "w") as fh:
                json.dump({"argv": sys.argv[-6:], **S}, fh)
    threading.Thread(target=dump, daemon=True, name="stepdump").start()
