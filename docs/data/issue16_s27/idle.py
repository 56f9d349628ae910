# idle.py CONFIG SECONDS [strace|threads]: CPU-s of each cluster process over SECONDS with no
# requests. With "strace": `strace -c -f` of each engine, master and conductor process for
# 15 s instead (summaries in /tmp/s27/idle/CONFIG_PROC.strace). With "threads" (session 28):
# per-thread CPU ticks over 20 s and the wake-up system calls of each process, per thread
# (strace logs in /tmp/s28/idle_CONFIG_PROC.st).
import sys, time, json, subprocess, os, collections, re
from pymooncake.cli.cluster import ClusterSpec, LocalCluster
from pymooncake.cli.bench_serving import BENCH_CONFIGS
name = sys.argv[1]; extra = BENCH_CONFIGS[name]
mode = sys.argv[3] if len(sys.argv) > 3 else ""
spec = ClusterSpec(port=0, quiet=True, max_model_len=8192, num_kv_blocks=2048,
                   global_segment_size=512 << 20,
                   num_prefill=3 if extra.get("colocated") else 2,
                   num_decode=0 if extra.get("colocated") else 1,
                   ttft_slo_s=50, tbt_slo_s=5, model="tiny", **extra)
def cluster_procs():
    out = subprocess.run("ps -eo pid,args | grep 'pymooncake \\(prefill\\|decode\\|master\\|"
                         "conductor\\|colocated\\)' | grep -v grep", shell=True,
                         capture_output=True, text=True).stdout
    procs = []
    for line in out.strip().splitlines():
        pid, args = line.split(None, 1)
        procs.append((args.split("--id ")[1].split()[0] if "--id " in args else args.split()[3], pid))
    return procs
def threads(pid):
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            comm = open(f"/proc/{pid}/task/{t}/comm").read().strip()
            f = open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()
            out[t] = (comm, int(f[11]) + int(f[12]))
        except OSError:
            pass
    return out
def per_thread(procs):
    os.makedirs("/tmp/s28", exist_ok=True)
    a = {tag: threads(pid) for tag, pid in procs}
    calls = "epoll_wait,epoll_pwait,poll,futex,select,pselect6,clock_nanosleep,nanosleep,sendto,recvfrom,sendmsg,recvmsg,write,read"
    st = [subprocess.Popen(["strace", "-f", "-e", f"trace={calls}", "-o",
                            f"/tmp/s28/idle_{name}_{tag}.st", "-p", pid], stderr=subprocess.DEVNULL)
          for tag, pid in procs]
    time.sleep(20)
    for p in st: p.send_signal(2)
    for p in st: p.wait()
    b = {tag: threads(pid) for tag, pid in procs}
    for tag, pid in procs:
        names = {t: v[0] for t, v in b[tag].items()}
        per = collections.Counter()
        for line in open(f"/tmp/s28/idle_{name}_{tag}.st"):
            m = re.match(r"(\d+)\s+(\w+)\(", line)
            if m: per[(names.get(m.group(1), m.group(1)), m.group(2))] += 1
        cpu = collections.Counter()
        for t, (comm, ticks) in b[tag].items():
            cpu[comm] += ticks - a[tag].get(t, (comm, 0))[1]
        print(f"== {tag} cpu ticks(20s, strace on) total {sum(cpu.values())}: {dict(cpu.most_common(8))}")
        print("   calls/20s:", {f"{k[0]}:{k[1]}": v for k, v in per.most_common(12)})
c = LocalCluster(spec)
try:
    c.start(); time.sleep(10)
    if mode == "strace":
        os.makedirs("/tmp/s27/idle", exist_ok=True)
        st = [subprocess.Popen(["strace", "-c", "-f", "-o", f"/tmp/s27/idle/{name}_{tag}.strace",
                                "-p", pid]) for tag, pid in cluster_procs()]
        time.sleep(15)
        for p in st: p.send_signal(2)
        for p in st: p.wait()
    elif mode == "threads":
        per_thread(cluster_procs())
    else:
        a = c.cpu_seconds(); time.sleep(float(sys.argv[2])); b = c.cpu_seconds()
        print(name, json.dumps({k: round(b[k] - a[k], 3) for k in b}))
finally:
    c.stop()
