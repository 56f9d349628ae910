import cProfile, pstats, time
from pymooncake.bench.transfer_subjects import Ours
if __name__ == "__main__":
    o = Ours("cma", 4 << 20, 8, 2)
    def sync():
        o._sync(o.writes); o._sync(o.reads)
    for _ in range(20): sync()
    pr = cProfile.Profile(); pr.enable()
    for _ in range(200): sync()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(18)
    o.close()
