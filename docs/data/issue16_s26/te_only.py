import sys
from pymooncake.bench.transfer import measure_pymooncake
if __name__ == "__main__":
    w, r, rounds, ok, cpu = measure_pymooncake("tcp", 16 << 20, 2, 2, float(sys.argv[1]))
    print("write GB/s", 32*2**20/w/1e9, "read", 32*2**20/r/1e9, rounds, ok, "cpu/GiB", cpu)
