# ph3.py OPS: session 27's ph2.py phases (env N calls, CL clients, default 4), with per phase
# the master's and the clients' user/system CPU (us a call), voluntary/involuntary context
# switches and minor faults a call, from /proc. Env MFLAGS: extra master flags (e.g.
# "--rpc-poll 0"); SPY=PREFIX: py-spy (2,000 Hz) of the master, or of client 0 with SPYC=1,
# to PREFIX_OP.txt per phase.
import os, sys, subprocess
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "issue16_s27"))
import ph2
from pymooncake.bench import store_procs as sp
def pstat(path):
    f = open(f"/proc/{path}/stat").read().rsplit(")", 1)[1].split()
    st = {l.split(":")[0]: l.split(":")[1].strip() for l in open(f"/proc/{path}/status")}
    return dict(minflt=int(f[7]), ut=int(f[11]), st=int(f[12]),
                vcs=int(st["voluntary_ctxt_switches"]), ivcs=int(st["nonvoluntary_ctxt_switches"]))
def tree(pid):
    tot = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            s = pstat(f"{pid}/task/{t}")
        except OSError:
            continue
        for k, v in s.items(): tot[k] = tot.get(k, 0) + v
    return tot
def main():
    if os.environ.get("MFLAGS"):
        sp.MASTER_FLAGS = (*sp.MASTER_FLAGS, *os.environ["MFLAGS"].split())
    ops = tuple(sys.argv[1].split(","))
    snaps, spy, pr = [], os.environ.get("SPY"), []
    def at(i, mpid, procs):
        snaps.append((tree(mpid), [tree(p.pid) for p in procs]))
        for p in pr: p.send_signal(2); p.wait()
        pr.clear()
        if spy and i < len(ops):
            who = procs[0].pid if os.environ.get("SPYC") else mpid
            pr.append(subprocess.Popen(["py-spy", "record", "-r", "2000", "--nonblocking", "-f", "raw", "-p", str(who), "-o", f"{spy}_{ops[i]}.txt"], stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
    n = int(os.environ.get("N", 10000))
    rates = ph2.run(ops, int(os.environ.get("CL", 4)), n, at)
    for i, op in enumerate(ops):
        tot = n * len(snaps[i][1]) * (16 if op == "batch_is_exist" else 1)
        m0, c0 = snaps[i]; m1, c1 = snaps[i + 1]
        dm = {k: m1[k] - m0[k] for k in m0}
        dc = {k: sum(b[k] - a[k] for a, b in zip(c0, c1)) for k in m0}
        us = lambda d: f"u {d['ut']*1e4/tot:.1f} s {d['st']*1e4/tot:.1f} µs/op vcs {d['vcs']/tot:.2f} ivcs {d['ivcs']/tot:.2f} flt {d['minflt']/tot:.2f}"
        print(f"{op:15} {rates[op][0]:8.0f} ops/s  master[{us(dm)}]  clients[{us(dc)}]")
if __name__ == "__main__":
    main()
