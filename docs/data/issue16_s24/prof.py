"""bench serving with py-spy recording every cluster process over the replay window."""
import sys, subprocess, signal, os
from pymooncake.cli import cluster as C
SPIES = []
N = [0]
orig = C.LocalCluster.cpu_seconds
def cpu_seconds(self):
    N[0] += 1
    if N[0] % 2 == 1:
        for n, p in self.procs.items():
            out = f"/tmp/s24/spy_{sys.argv[2]}_{n}.txt"
            SPIES.append(subprocess.Popen(["/tmp/s24/tools/bin/py-spy", "record", "-r", "200", "--nonblocking", "--threads", "-f", "raw", "-o", out, "-p", str(p.pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    else:
        for s in SPIES: s.send_signal(signal.SIGINT)
        for s in SPIES: s.wait()
        SPIES.clear()
    return orig(self)
C.LocalCluster.cpu_seconds = cpu_seconds
from pymooncake.cli.main import main
sys.exit(main(["bench", "serving", "--configs", sys.argv[1], "--json"]))
