import os, sys


def _thread_cpu():
    """CPU seconds of each thread of this process, keyed "tid:python thread name"."""
    import threading
    names = {t.native_id: t.name for t in threading.enumerate()}
    tasks = {}
    for t in os.listdir("/proc/self/task"):
        try:
            f = open(f"/proc/self/task/{t}/stat").read().rsplit(")", 1)[1].split()
            tasks[f"{t}:{names.get(int(t), '?')}"] = (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            pass
    return tasks


if os.environ.get("PMK_INST") and ("decode" in sys.argv or "prefill" in sys.argv):
    import time, json, threading
    from pymooncake.engine import engine as en
    from pymooncake.engine import scheduler as sc
    from pymooncake.engine import runner as rn
    from pymooncake.engine.worker import decode as dw
    from pymooncake.engine.worker import prefill as pw
    from pymooncake.engine import kv_layerwise as kl, kv_loader as kld, kv_receiver as kr
    from pymooncake.engine.worker import stages as sg
    from pymooncake.engine import hooks as hk
    st = {}
    reqs = {}
    steps = []
    def add(tag, ns):
        s = st.setdefault(tag, [0, 0]); s[0] += ns; s[1] += 1
    def wrap(cls, name, tag):
        f = cls.__dict__.get(name)
        if f is None:
            return
        def w(*a, **k):
            t = time.thread_time_ns()
            try:
                return f(*a, **k)
            finally:
                add(tag, time.thread_time_ns() - t)
        setattr(cls, name, w)
    ex = rn.ModelRunner.execute
    def execute(self, out):
        npre = sum(s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1 or s.request.num_computed_tokens == 0)
        ndec = len(out.scheduled) - sum(1 for s in out.scheduled if s.num_new_tokens > 1 or s.request.num_computed_tokens == 0)
        for s_ in out.scheduled:
            r = s_.request
            if r.num_computed_tokens < r.num_prompt_tokens:
                e = reqs.setdefault(r.request_id, [r.num_prompt_tokens, r.num_computed_tokens, 0, 0])
                e[2] += s_.num_new_tokens; e[3] = max(e[3], r.num_preemptions)
        t = time.thread_time_ns()
        out.scheduled  # noqa
        try:
            return ex(self, out)
        finally:
            d = time.thread_time_ns() - t
            if npre:
                steps.append((npre, sum(s_.num_new_tokens * (s_.request.num_computed_tokens + s_.num_new_tokens / 2) for s_ in out.scheduled if s_.num_new_tokens > 1), len(out.scheduled), d, [(s_.request.request_id, s_.request.num_prompt_tokens, s_.request.num_computed_tokens, s_.num_new_tokens) for s_ in out.scheduled]))
                add("exec_prefill_steps", d); add("prefill_tokens", npre); add("riding_decodes", ndec)
            else:
                add("exec_decode_only", d); add("decode_rows", ndec)
    rn.ModelRunner.execute = execute
    wrap(en.Engine, "step", "step")
    for cls, tag in ((kl.LayerwiseKVSender, "lw"), (kld.StoreKVLoader, "loader"), (sg.StageClock, "clock"),
                     (hk.BlockTables, "tables"), (kr.KVReceiver, "recv")):
        for m in ("start_step", "before_layer", "after_layer", "end_step"):
            wrap(cls, m, f"{tag}.{m}")
    wrap(dw.DecodeWorker, "after_step", "d.after_step")
    wrap(pw.PrefillWorker, "after_step", "p.after_step")
    ident = sys.argv[sys.argv.index("--id") + 1] if "--id" in sys.argv else str(os.getpid())
    def dump():
        while True:
            time.sleep(2)
            json.dump({"st": st, "tasks": _thread_cpu(), "reqs": reqs, "steps": steps},
                      open(f"/tmp/s29/inst/{ident}.json", "w"))
    threading.Thread(target=dump, daemon=True, name="inst-dump").start()

if os.environ.get("PMK_THREADS") and "pymooncake" in " ".join(sys.argv[:3]) or (os.environ.get("PMK_THREADS") and any(a in sys.argv for a in ("master", "conductor", "prefill", "decode"))):
    import time, json, threading
    _ident = sys.argv[sys.argv.index("--id") + 1] if "--id" in sys.argv else next((a for a in ("master", "conductor") if a in sys.argv), str(os.getpid()))
    def _dump_threads():
        while True:
            time.sleep(2)
            json.dump(_thread_cpu(), open(f"/tmp/s29/thr/{_ident}.json", "w"))
    threading.Thread(target=_dump_threads, daemon=True, name="thr-dump").start()
if os.environ.get("PMK_LOOP") and any(a in sys.argv for a in ("prefill", "decode")):
    import time, json, threading, queue, collections, logging
    from pymooncake.engine.worker import base as wb
    lst = collections.defaultdict(lambda: [0, 0])
    def _add(tag, ns):
        e = lst[tag]; e[0] += ns; e[1] += 1
    tt = time.thread_time_ns
    def _engine_main(self):
        first = [None]
        while not self._stop.is_set():
            t0 = tt()
            busy = self.engine.has_unfinished()
            if not busy:
                self.on_idle()
                _add("on_idle", tt() - t0)
            t1 = tt()
            try:
                cmd = self._cmds.get(timeout=0 if busy else wb.IDLE_WAIT_S)
            except queue.Empty:
                cmd = None
            _add("get" if busy else "get_idle", tt() - t1)
            while cmd is not None:
                t2 = tt()
                cmd()
                name = getattr(cmd, "__qualname__", None) or getattr(getattr(cmd, "func", None), "__qualname__", "?")
                _add("cmd:" + name, tt() - t2)
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    cmd = None
            if self.engine.has_unfinished():
                batch = len(self.engine.scheduler.running)
                t3 = tt()
                t = time.perf_counter()
                try:
                    outs = self.engine.step()
                    self.on_step_timed(batch, time.perf_counter() - t)
                except Exception:
                    logging.exception("engine step failed")
                    outs = []
                    for rid in list(self.engine.requests):
                        self.engine.abort(rid)
                        self.on_failed(rid, "engine step failed")
                _add("step", tt() - t3)
                t4 = tt()
                self.after_step(outs)
                _add("after_step", tt() - t4)
            t5 = tt()
            self._collect_kv_events()
            _add("kv_events", tt() - t5)
            _add("loop_total", tt() - t0)
    wb.EngineWorker._engine_main = _engine_main
    _id = sys.argv[sys.argv.index("--id") + 1]
    def _dump():
        while True:
            time.sleep(2)
            json.dump(lst, open(f"/tmp/s29/loop/{_id}.json", "w"))
    threading.Thread(target=_dump, daemon=True, name="loop-dump").start()
if os.environ.get("PMK_IMPORTS") and any(a in sys.argv for a in ("prefill", "decode", "master", "conductor", "replay")):
    import time, json, threading, collections
    _imp = collections.Counter()
    def _hook(ev, args):
        if ev == "import":
            _imp[args[0]] += 1
    sys.addaudithook(_hook)
    _iid = sys.argv[sys.argv.index("--id") + 1] if "--id" in sys.argv else next(a for a in ("master", "conductor", "replay") if a in sys.argv)
    def _dump_imp():
        while True:
            time.sleep(2)
            json.dump({m: n for m, n in _imp.items() if m not in sys.modules}, open(f"/tmp/s29/imp/{_iid}.json", "w"))
    threading.Thread(target=_dump_imp, daemon=True, name="imp-dump").start()
if os.environ.get("PMK_MAINPROF") and any(a in sys.argv for a in ("decode",)):
    import cProfile, atexit
    _pr = cProfile.Profile(__import__("time").thread_time)
    _pr.enable()
    _pid = sys.argv[sys.argv.index("--id") + 1]
    def _save():
        _pr.disable()
        _pr.dump_stats(f"/tmp/s29/mainprof/{_pid}.prof")
    atexit.register(_save)
