"""bench serving with a signal window over the replay: SIGUSR1 at its start and SIGUSR2 at
its end to the cluster processes whose names start with a prefix in PMK_WINDOW_PROCS
(e.g. "master,conductor" or "prefill,decode"). The sitecustomize_*.py probes start and stop
on those signals. Usage: PMK_WINDOW_PROCS=... python window.py CONFIGS"""
import sys, os, signal, time
from pymooncake.cli import cluster as C
N = [0]
orig = C.LocalCluster.cpu_seconds
def cpu_seconds(self):
    N[0] += 1
    sig = signal.SIGUSR1 if N[0] % 2 == 1 else signal.SIGUSR2
    for n, p in self.procs.items():
        if any(n.startswith(r) for r in os.environ["PMK_WINDOW_PROCS"].split(",") if r):
            os.kill(p.pid, sig)
    if sig == signal.SIGUSR2:
        time.sleep(3)   # the probes write their files
    return orig(self)
C.LocalCluster.cpu_seconds = cpu_seconds
from pymooncake.cli.main import main
sys.exit(main(["bench", "serving", "--configs", sys.argv[1], "--json"]))
