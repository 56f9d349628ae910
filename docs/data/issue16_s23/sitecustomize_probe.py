import ctypes, os, sys, threading, time
if os.environ.get("PMK_MALLOPT"):
    libc = ctypes.CDLL("libc.so.6")
    for k, v in ((-1, 1 << 30), (-2, 64 << 20), (-3, 32 << 20)):
        assert libc.mallopt(k, v) == 1, (k, v)
if os.environ.get("PMK_MI") and (b"\0prefill\0" in open("/proc/self/cmdline", "rb").read() or b"\0decode\0" in open("/proc/self/cmdline", "rb").read()):
    class MI(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc2 = ctypes.CDLL("libc.so.6"); libc2.mallinfo2.restype = MI
    def loop():
        f = open(f"/tmp/s23/mi_{os.getpid()}.log", "w")
        while True:
            m = libc2.mallinfo2(); rss = int(open("/proc/self/statm").read().split()[1]) * 4 >> 10
            f.write(f"{time.time():.0f} rss {rss} arena {m.arena>>20} inuse {m.uordblks>>20} free {m.fordblks>>20} mmapped {m.hblkhd>>20} nmmap {m.hblks}\n"); f.flush()
            time.sleep(5)
    threading.Thread(target=loop, daemon=True).start()
if os.environ.get("PMK_OBJ") and b"\0prefill\0" in open("/proc/self/cmdline", "rb").read():
    import tracemalloc
    def oloop():
        import gc, collections
        n = 0
        time.sleep(20); tracemalloc.start(12)
        while True:
            time.sleep(30); n += 1
            try:
                import torch
                c = collections.Counter(); b = collections.Counter()
                for o in gc.get_objects():
                    if isinstance(o, torch.Tensor):
                        try:
                            k = (tuple(o.shape), str(o.dtype)); c[k] += 1; b[k] += o.untyped_storage().nbytes()
                        except Exception: pass
                snap = tracemalloc.take_snapshot()
                with open(f"/tmp/s23/obj_{os.getpid()}_{n}.txt", "w") as f:
                    f.write(f"tensors {sum(c.values())} bytes {sum(b.values())>>20} MiB\n")
                    for k, v in b.most_common(15): f.write(f"  {v>>10} KiB x{c[k]} {k}\n")
                    for st in snap.statistics("traceback")[:8]:
                        f.write(f"-- {st.size>>10} KiB {st.count} blocks\n")
                        for line in st.traceback.format()[-12:]: f.write("   " + line + "\n")
            except Exception as e:
                open(f"/tmp/s23/obj_{os.getpid()}_err.txt", "w").write(repr(e))
    threading.Thread(target=oloop, daemon=True).start()
