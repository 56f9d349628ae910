"""bench serving with yappi started/stopped (SIGUSR1/2) in chosen processes over the replay window."""
import sys, os, signal, time
from pymooncake.cli import cluster as C
N = [0]
orig = C.LocalCluster.cpu_seconds
def cpu_seconds(self):
    N[0] += 1
    sig = signal.SIGUSR1 if N[0] % 2 == 1 else signal.SIGUSR2
    for n, p in self.procs.items():
        if n not in ("master", "conductor"):
            os.kill(p.pid, sig)
    if sig == signal.SIGUSR2:
        time.sleep(3)
    return orig(self)
C.LocalCluster.cpu_seconds = cpu_seconds
from pymooncake.cli.main import main
sys.exit(main(["bench", "serving", "--configs", sys.argv[1], "--json"]))
