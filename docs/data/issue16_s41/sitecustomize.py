import os, sys
_who = os.environ.get("PMK_CPROF")
if _who and len(sys.argv) > 0 and any(a == _who for a in sys.argv[1:3]) or (_who and _who in " ".join(sys.argv[:3])):
    import cProfile, time, atexit, signal
    _p = cProfile.Profile(time.process_time)
    _p.enable()
    def _dump(*a):
        _p.disable()
        _p.dump_stats(f"/tmp/s41/cprof_{os.environ.get('PMK_CPROF_TAG','x')}_{_who}_{os.getpid()}.prof")
    atexit.register(_dump)
    def _term(*a):
        _dump(); os._exit(0)
    signal.signal(signal.SIGTERM, _term)
