# idle_thr.py CONFIG: per-thread idle CPU (ticks over 20 s) and wake-ups (strace 10 s) of every cluster process
import sys, time, json, subprocess, os, collections, re
from pymooncake.cli.cluster import ClusterSpec, LocalCluster
from pymooncake.cli.bench_serving import BENCH_CONFIGS
name = sys.argv[1]; extra = BENCH_CONFIGS[name]
spec = ClusterSpec(port=0, quiet=True, max_model_len=8192, num_kv_blocks=2048,
                   global_segment_size=512 << 20,
                   num_prefill=3 if extra.get("colocated") else 2,
                   num_decode=0 if extra.get("colocated") else 1,
                   ttft_slo_s=50, tbt_slo_s=5, model="tiny", **extra)
def threads(pid):
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            comm = open(f"/proc/{pid}/task/{t}/comm").read().strip()
            f = open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()
            out[t] = (comm, int(f[11]) + int(f[12]))
        except Exception:
            pass
    return out
c = LocalCluster(spec)
try:
    c.start(); time.sleep(8)
    out = subprocess.run("ps -eo pid,args | grep 'pymooncake \\(prefill\\|decode\\|master\\|conductor\\|serve\\|colocated\\)' | grep -v grep", shell=True, capture_output=True, text=True).stdout
    procs = []
    for line in out.strip().splitlines():
        pid, args = line.split(None, 1)
        tag = args.split("--id ")[1].split()[0] if "--id " in args else args.split()[3]
        procs.append((tag, pid))
    a = {tag: threads(pid) for tag, pid in procs}
    st = [subprocess.Popen(["strace", "-f", "-e", "trace=epoll_wait,epoll_pwait,poll,futex,select,pselect6,clock_nanosleep,nanosleep,sendto,recvfrom,sendmsg,recvmsg,write,read", "-o", f"/tmp/s28/idle_{name}_{tag}.st", "-p", pid], stderr=subprocess.DEVNULL) for tag, pid in procs]
    time.sleep(20)
    for p in st: p.send_signal(2)
    for p in st: p.wait()
    b = {tag: threads(pid) for tag, pid in procs}
    for tag, pid in procs:
        per = collections.Counter()
        names = {t: v[0] for t, v in b[tag].items()}
        for line in open(f"/tmp/s28/idle_{name}_{tag}.st"):
            m = re.match(r"(\d+)\s+(\w+)\(", line)
            if m: per[(names.get(m.group(1), m.group(1)), m.group(2))] += 1
            elif not line[0].isdigit():
                m = re.match(r"(\w+)\(", line)
                if m: per[(names.get(pid, pid), m.group(1))] += 1
        cpu = collections.Counter()
        for t, (comm, ticks) in b[tag].items():
            cpu[comm] += ticks - a[tag].get(t, (comm, 0))[1]
        print(f"== {tag} cpu ticks(20s, strace on) total {sum(cpu.values())}: {dict(cpu.most_common(8))}")
        print("   calls/20s:", {f"{k[0]}:{k[1]}": v for k, v in per.most_common(12)})
finally:
    c.stop()
