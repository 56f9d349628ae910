"""bench serving global-cache; perf-record page faults (-d: data addresses) and the mmap/munmap/madvise/brk/mprotect syscalls of prefill-0 and decode-0 over the replay."""
import sys, subprocess, shutil
from pymooncake.cli import cluster as C
PERF = []
orig = C.LocalCluster.cpu_seconds
def cpu_seconds(self):
    if not PERF:
        for n in ("prefill-0", "decode-0", "colocated-0"):
            if n in self.procs:
                pid = self.procs[n].pid
                shutil.copy(f"/proc/{pid}/maps", f"/tmp/s23/maps_{n}_before")
                PERF.append((n, pid, subprocess.Popen(["perf", "record", "-q", "-e", "page-faults", "-c", "1", "-d", "-e", "syscalls:sys_enter_munmap", "-e", "syscalls:sys_enter_madvise", "-e", "syscalls:sys_enter_mmap", "-e", "syscalls:sys_enter_brk", "-e", "syscalls:sys_enter_mprotect", "-p", str(pid), "-o", f"/tmp/s23/pf_{n}.data"])))
    else:
        for n, pid, p in PERF:
            shutil.copy(f"/proc/{pid}/maps", f"/tmp/s23/maps_{n}")
            p.send_signal(2); p.wait()
        PERF.clear()
    return orig(self)
C.LocalCluster.cpu_seconds = cpu_seconds
from pymooncake.cli.main import main
sys.exit(main(["bench", "serving", "--configs", sys.argv[1], "--json"]))
