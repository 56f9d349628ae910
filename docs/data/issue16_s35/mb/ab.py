"""shm against cma in one process, rounds taken in turn with memcpy (session 35).

Three subjects from ``bench.transfer_subjects``: our engine over shm (target: a /dev/shm
buffer of a child process), our engine over cma (target: a numpy array of another child)
and the numpy memcpy reference; ``bench.transfer.measure_rounds`` alternates single rounds
of them. Prints each repeat's ratios and the median [q1-q3] over repeats.
Usage: python ab.py [REPEATS] [SIZE] [BATCH]"""
import statistics
import sys

from pymooncake.bench.transfer import measure_rounds
from pymooncake.bench.transfer_subjects import Memcpy, Ours

if __name__ == "__main__":
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 9
    size = int(sys.argv[2]) if len(sys.argv) > 2 else 4 << 20
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    shm, cma, mc = Ours("shm", size, batch, 2), Ours("cma", size, batch, 2), Memcpy(size, batch)
    shm.name, cma.name = "shm", "cma"
    got = {"shm": [], "cma": [], "cma/shm": []}
    try:
        for r in range(reps):
            out = measure_rounds([shm, cma, mc], 0.5, rotation=r)
            t = {k: v[0] + v[1] for k, v in out.items()}
            assert all(v[4] for v in out.values()), out
            row = {"shm": t["memcpy"] / t["shm"], "cma": t["memcpy"] / t["cma"],
                   "cma/shm": t["shm"] / t["cma"]}
            for k, v in row.items():
                got[k].append(v)
            print(r, {k: round(v, 3) for k, v in row.items()}, flush=True)
    finally:
        for s in (shm, cma, mc):
            s.close()
    for k, v in got.items():
        q = statistics.quantiles(v, n=4, method="inclusive")
        print(f"{k:8s} {statistics.median(v):.3f} [{q[0]:.3f}-{q[2]:.3f}]")
