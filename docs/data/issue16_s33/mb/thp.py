import numpy as np, time, statistics, mmap, ctypes
N = 32 << 20
def bufs():
    return np.ones(N, np.uint8), np.zeros(N, np.uint8)
def shm_buf():
    m = mmap.mmap(-1, N, flags=mmap.MAP_SHARED)
    a = np.frombuffer(m, np.uint8); a[:] = 0; return a, m
a, b = bufs()
np.core.multiarray._set_madvise_hugepage(False) if hasattr(np.core.multiarray, "_set_madvise_hugepage") else None
c, d = bufs()
s, m = shm_buf()
def bw(src, dst):
    t = time.perf_counter()
    for i in range(8): np.copyto(dst[i*(4<<20):(i+1)*(4<<20)], src[i*(4<<20):(i+1)*(4<<20)])
    return N / (time.perf_counter() - t) / 1e9
r = {"thp": [], "nothp": [], "to_shm_thp_src": []}
for _ in range(30):
    r["thp"].append(bw(a, b)); r["nothp"].append(bw(c, d)); r["to_shm_thp_src"].append(bw(a, s))
for k, v in r.items(): print(k, round(statistics.median(v), 2))
import subprocess; print(open('/proc/self/smaps_rollup').read().split('AnonHugePages:')[1].split('\n')[0])
