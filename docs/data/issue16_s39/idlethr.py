import sys, os, time, subprocess, re, json
sys.path.insert(0, "/work/main/docs/data/issue16_s37/mb")
from harness import bench_args
from pymooncake.cli.bench_serving import cluster_spec
from pymooncake.cli.cluster import LocalCluster
from collections import Counter
c = LocalCluster(cluster_spec("global-cache", bench_args())); c.start()
try:
    time.sleep(3)
    for who in ("prefill-0", "decode-0", "master"):
        pid = c.pids()[who]
        d = subprocess.run([".venv/bin/py-spy", "dump", "-p", str(pid), "--json"], capture_output=True, text=True).stdout
        names = {str(t["os_thread_id"]): t["thread_name"] for t in json.loads(d)} if d else {}
        r = subprocess.run(["timeout", "-s", "INT", "10", "strace", "-f", "-e", "trace=!futex,getpid", "-p", str(pid)], capture_output=True, text=True)
        cnt = Counter()
        for l in r.stderr.splitlines():
            m = re.match(r"\[pid\s+(\d+)\]\s+(\w+)\((.{0,40})", l)
            if m: cnt[(names.get(m.group(1), m.group(1)), m.group(2), m.group(3)[:25] if m.group(2) in ('sendto','recvfrom','epoll_wait') else '')] += 1
            else:
                m = re.match(r"(\w+)\((.{0,40})", l)
                if m: cnt[(names.get(str(pid), 'main'), m.group(1), m.group(2)[:25] if m.group(1) in ('epoll_wait',) else '')] += 1
        print("=====", who)
        for k, v in cnt.most_common(20): print(v, k)
finally:
    c.stop()
