import os
if os.environ.get("PMK_RM"):
    import sys
    if "master" in sys.argv:
        from pymooncake.store.master import service_handlers as sh
        mode = os.environ["PMK_RM"]
        orig = sh.HandlerMethods._remove
        if mode == "nop":
            sh.HandlerMethods._remove = lambda self, p: True
        elif mode == "noafter":
            def _r(self, p):
                self.core.remove(p.key, self.now_ms(), p.force)
                return True
            sh.HandlerMethods._remove = _r
        elif mode == "lookup":
            def _r(self, p):
                self.core._lookup(p.key)
                return True
            sh.HandlerMethods._remove = _r
        elif mode == "nofree":
            from pymooncake.store.master import allocator as al
            al.SegmentPool.free = lambda self, s, a: None
        elif mode == "defer":
            from pymooncake.store.master import objects as ob
            keep = []
            op = ob.ObjectTable.pop
            def pop(self, key):
                o = op(self, key); keep.append(o); return o
            ob.ObjectTable.pop = pop
        elif mode == "both":
            from pymooncake.store.master import allocator as al
            al.SegmentPool.free = lambda self, s, a: None
            from pymooncake.store.master import objects as ob
            keep = []
            op = ob.ObjectTable.pop
            def pop(self, key):
                o = op(self, key); keep.append(o); return o
            ob.ObjectTable.pop = pop
if os.environ.get("PMK_TIME"):
    import sys
    if "master" in sys.argv:
        import time
        from pymooncake.store.master import service_handlers as sh
        from pymooncake.store.master import core_objects as co
        from pymooncake.rpc import server as srv
        st = {"rm": [0, 0], "ex": [0, 0], "disp": [0, 0]}
        def wrap(cls, name, tag):
            f = getattr(cls, name)
            def w(*a, **k):
                t = time.perf_counter_ns()
                try:
                    return f(*a, **k)
                finally:
                    s = st[tag]; s[0] += time.perf_counter_ns() - t; s[1] += 1
                    if tag == "disp" and s[1] % 20000 == 0:
                        with open(os.environ["PMK_TIME"], "a") as fh:
                            fh.write(" ".join(f"{k}={v[0]/max(v[1],1)/1000:.2f}us/{v[1]}" for k, v in st.items()) + "\n")
                        for v in st.values(): v[0] = v[1] = 0
            setattr(cls, name, w)
        wrap(co.ObjectMethods, "remove", "rm")
        from pymooncake.store.master import core as mc, allocator as al, objects as ob, leases as le
        for cls, name in ((mc.MasterCore, "_lookup"), (al.SegmentPool, "free"), (ob.ObjectTable, "pop"), (le.LeaseTable if hasattr(le, "LeaseTable") else None, "is_leased"), (mc.MasterCore, "_delete")):
            if cls is None: continue
            st[name] = [0, 0]; wrap(cls, name, name)
        wrap(sh.HandlerMethods, "_exist", "ex")
        wrap(srv.RpcServer, "_dispatch", "disp")
