"""bench serving with per-process/thread minflt + RSS deltas over the replay window (scratch)."""
import sys, json, glob
from pymooncake.cli import cluster as C

def stat(path):
    s = open(path).read(); rest = s[s.rfind(")") + 2:].split()
    return int(rest[7]), (int(rest[11]) + int(rest[12])) / 100

def snap(procs):
    out = {}
    for n, p in procs.items():
        try:
            mf, cpu = stat(f"/proc/{p.pid}/stat")
            th = {}
            for t in glob.glob(f"/proc/{p.pid}/task/*"):
                try:
                    comm = open(t + "/comm").read().strip()
                    th[t.rsplit("/", 1)[1] + ":" + comm] = stat(t + "/stat")
                except OSError: pass
            rss = int(open(f"/proc/{p.pid}/statm").read().split()[1]) * 4096 >> 20
            out[n] = dict(minflt=mf, cpu=cpu, rss=rss, th=th)
        except OSError: pass
    return out

SNAPS = []
orig = C.LocalCluster.cpu_seconds
def cpu_seconds(self):
    SNAPS.append(snap(self.procs))
    if len(SNAPS) % 2 == 0:
        a, b = SNAPS[-2], SNAPS[-1]
        for n in b:
            if n not in a: continue
            print(f"{n:12} cpu {b[n]['cpu']-a[n]['cpu']:7.2f} minflt {b[n]['minflt']-a[n]['minflt']:9d} rss {a[n]['rss']}->{b[n]['rss']} MiB", file=sys.stderr)
            for t, (mf, c) in b[n]["th"].items():
                m0, c0 = a[n]["th"].get(t, (0, 0))
                if mf - m0 > 2000 or c - c0 > 0.3:
                    print(f"     {t:28} cpu {c-c0:7.2f} minflt {mf-m0:9d}", file=sys.stderr)
    return orig(self)
C.LocalCluster.cpu_seconds = cpu_seconds
from pymooncake.cli.main import main
sys.exit(main(["bench", "serving", "--configs", sys.argv[1], "--json"]))
