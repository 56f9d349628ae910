import ctypes, numpy as np, time, threading, statistics
from concurrent.futures import ThreadPoolExecutor
N = 4 << 20; B = 8
src = [np.ones(N, np.uint8) for _ in range(B)]; dst = [np.zeros(N, np.uint8) for _ in range(B)]
pool = ThreadPoolExecutor(2)
def one():
    for s, d in zip(src, dst): ctypes.memmove(d.ctypes.data, s.ctypes.data, N)
def two():
    def half(k):
        for s, d in zip(src, dst):
            o = k * (N // 2); ctypes.memmove(d.ctypes.data + o, s.ctypes.data + o, N // 2)
    f = pool.submit(half, 1); half(0); f.result()
def two_b():  # split by objects
    def part(k):
        for i in range(k, B, 2): ctypes.memmove(dst[i].ctypes.data, src[i].ctypes.data, N)
    f = pool.submit(part, 1); part(0); f.result()
for f in (one, two, two_b): f()
res = {f.__name__: [] for f in (one, two, two_b)}
for r in range(15):
    for f in (one, two, two_b):
        t = time.perf_counter(); 
        for _ in range(5): f()
        res[f.__name__].append(5 * B * N / (time.perf_counter() - t) / 1e9)
for k, v in res.items(): print(k, "GB/s median", round(statistics.median(v), 2), "min", round(min(v), 2), "max", round(max(v), 2))
