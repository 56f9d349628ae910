import argparse, os, subprocess, sys, time
from pymooncake.cli.bench_serving import cluster_spec, replay_argv
from pymooncake.cli.cluster import LocalCluster
name, who, lim = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
args = argparse.Namespace(prefill=2, decode=1, global_segment_size=512 << 20, ttft_slo=5.0, tbt_slo=0.5, model="tiny",
                          decode_step_interval_s=0.0, limit=lim, time_scale=1.0, length_scale=32)
c = LocalCluster(cluster_spec(name, args)); c.start()
try:
    sp = [subprocess.Popen(["strace", "-c", "-f", "-p", str(c.pids()[w]), "-o", f"/tmp/s41/strace_{name}_{w}.txt"], stderr=subprocess.DEVNULL) for w in who]
    time.sleep(1)
    subprocess.run(replay_argv(c.url, args, skip=0, limit=lim), capture_output=True, text=True)
    for s in sp: s.send_signal(2); s.wait()
finally:
    c.stop()
