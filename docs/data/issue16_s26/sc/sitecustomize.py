import os, sys, signal
_argv = open(f"/proc/{os.getpid()}/cmdline").read().split("\0")
if "master" in _argv and "pymooncake" in _argv:
    import cProfile
    _p = [None]
    def _start(*a):
        _p[0] = cProfile.Profile(); _p[0].enable()
    def _stop(*a):
        _p[0].disable(); _p[0].dump_stats(os.environ.get("PROF_OUT", "/tmp/s26/master.prof"))
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
