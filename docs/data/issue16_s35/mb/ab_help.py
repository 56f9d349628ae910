"""A waiter that runs its own queued copies (``LocalCopier.help``) against one that sleeps
until the copy thread is done, in one process, rounds taken in turn with memcpy.

Two engines over the same transport, one with ``help`` turned off, and the numpy memcpy
reference (``bench.transfer.measure_rounds``: rotated, forwards and backwards).
Usage: python ab_help.py TRANSPORT [REPEATS]

It ran against a trial ``LocalCopier.help`` that was not kept (docs/benchmarks.md, issue 16
session 35); on main the "help" engine no longer helps."""
import statistics
import sys

from pymooncake.bench.transfer import measure_rounds
from pymooncake.bench.transfer_subjects import Memcpy, Ours

if __name__ == "__main__":
    transport = sys.argv[1]
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 9
    on, off, mc = Ours(transport, 4 << 20, 8, 2), Ours(transport, 4 << 20, 8, 2), Memcpy(4 << 20, 8)
    on.name, off.name = "help", "nohelp"
    off.eng._copier.help = lambda batch_id: None
    got = {"help": [], "nohelp": [], "help/nohelp": []}
    try:
        for r in range(reps):
            out = measure_rounds([on, off, mc], 0.5, rotation=r)
            assert all(v[4] for v in out.values()), out
            t = {k: v[0] + v[1] for k, v in out.items()}
            row = {"help": t["memcpy"] / t["help"], "nohelp": t["memcpy"] / t["nohelp"],
                   "help/nohelp": t["nohelp"] / t["help"]}
            for k, v in row.items():
                got[k].append(v)
            print(r, {k: round(v, 3) for k, v in row.items()}, flush=True)
    finally:
        for s in (on, off, mc):
            s.close()
    for k, v in got.items():
        q = statistics.quantiles(v, n=4, method="inclusive")
        print(f"{transport} {k:12s} {statistics.median(v):.3f} [{q[0]:.3f}-{q[2]:.3f}]")
