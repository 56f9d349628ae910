import sys, os, time, argparse, subprocess, json
from pymooncake.cli.bench_serving import cluster_spec, replay_argv
from pymooncake.cli.cluster import LocalCluster
if __name__ == "__main__":
    name, who, lim = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
    args = argparse.Namespace(prefill=2, decode=1, global_segment_size=512 << 20, ttft_slo=5.0,
                              tbt_slo=0.5, model="tiny", decode_step_interval_s=float(os.environ.get("PACE", "0")),
                              limit=lim, time_scale=1.0, length_scale=32)
    c = LocalCluster(cluster_spec(name, args)); c.start()
    try:
        spies = [subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-F", "1000", "-g", "-p", str(c.pids()[w]), "-o", f"/tmp/s36/perf_{w}.data"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) if os.environ.get("PERF") else subprocess.Popen([".venv/bin/py-spy", "record", "-p", str(c.pids()[w]), "-r", os.environ.get("RATE", "200"), "-f", "raw", "-o", f"/tmp/s36/r_{w}.raw", "--threads", "--nonblocking"] + (["--gil"] if os.environ.get("GIL") else []), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for w in who]
        time.sleep(1); c0 = c.cpu_seconds()
        r = subprocess.run(replay_argv(c.url, args, skip=0, limit=lim), capture_output=True, text=True)
        c1 = c.cpu_seconds()
        for s in spies: s.send_signal(2); s.wait()
        print({k: round(c1[k] - c0[k], 2) for k in c1})
    finally:
        c.stop()
