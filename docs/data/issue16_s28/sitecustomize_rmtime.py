import os, sys
if os.environ.get("PMK_TIME") and "master" in sys.argv:
    import time
    from pymooncake.store.master import core_objects as co
    st = [0, 0]
    f = co.ObjectMethods.remove
    def w(*a, **k):
        t = time.perf_counter_ns()
        try:
            return f(*a, **k)
        finally:
            st[0] += time.perf_counter_ns() - t; st[1] += 1
            if st[1] % 10000 == 0:
                with open(os.environ["PMK_TIME"], "a") as fh:
                    fh.write(f"{st[0]/st[1]/1000:.3f}\n")
                st[0] = st[1] = 0
    co.ObjectMethods.remove = w
