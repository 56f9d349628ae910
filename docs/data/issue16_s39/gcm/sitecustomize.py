import os, sys
ROLES = ("prefill", "decode", "worker", "conductor", "master")
if os.environ.get("PMK_GCM") and any(a in sys.argv for a in ROLES):
    import gc, json, threading, time, atexit
    S = {"n": [0, 0, 0], "ns": [0, 0, 0], "collected": 0}
    t0 = [0]
    def cb(phase, info):
        if phase == "start":
            t0[0] = time.thread_time_ns()
        else:
            g = info["generation"]; S["n"][g] += 1; S["ns"][g] += time.thread_time_ns() - t0[0]
            S["collected"] += info["collected"]
    gc.callbacks.append(cb)
    role = next(a for a in ROLES if a in sys.argv)
    ident = sys.argv[sys.argv.index("--id") + 1] if "--id" in sys.argv else role
    def dump():
        S["objects"] = len(gc.get_objects()); S["frozen"] = gc.get_freeze_count()
        S["cpu"] = time.process_time()
        os.makedirs("/tmp/gcm/out", exist_ok=True)
        with open(f"/tmp/gcm/out/{os.environ.get('PMK_GCM')}_{ident}.json", "w") as f:
            json.dump(S, f)
    def loop():
        while True:
            time.sleep(2); dump()
    threading.Thread(target=loop, daemon=True).start()
    if os.environ.get("PMK_GC_FREEZE"):
        def fr():
            gc.collect(); gc.freeze()
        threading.Timer(float(os.environ["PMK_GC_FREEZE"]), fr).start()
