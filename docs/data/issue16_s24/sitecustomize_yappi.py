import os, sys, signal
_role = os.environ.get("PMK_YAPPI_ROLES", "")
_argv = open(f"/proc/{os.getpid()}/cmdline").read().split("\0")
_me = None
for r in _role.split(","):
    if r and r in _argv:
        _me = r
if _me and "pymooncake" in _argv:
    sys.path.insert(0, "/tmp/s24/yp")
    import yappi
    yappi.set_clock_type("cpu")
    def _start(*a):
        yappi.clear_stats(); yappi.start(builtins=True, profile_threads=os.environ.get("PMK_YAPPI_THREADS", "1") != "0")
    def _stop(*a):
        yappi.stop()
        tag = os.environ.get("PMK_YAPPI_TAG", "x")
        fs = yappi.get_func_stats()
        fs.save(f"/tmp/s24/yappi_{tag}_{_me}_{os.getpid()}.pstat", type="pstat")
        with open(f"/tmp/s24/yappi_{tag}_{_me}_{os.getpid()}.threads.txt", "w") as f:
            yappi.get_thread_stats().print_all(out=f)
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
