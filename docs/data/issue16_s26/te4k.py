import sys
from pymooncake.bench.transfer import measure_pymooncake
if __name__ == "__main__":
    w, r, rounds, ok, cpu = measure_pymooncake("tcp", 4096, 128, 2, float(sys.argv[1]))
    print("4k write MB/s %.1f read %.1f rounds %d ok %s cpu/GiB %.2f" % (512*1024/w/1e6, 512*1024/r/1e6, rounds, ok, cpu))
