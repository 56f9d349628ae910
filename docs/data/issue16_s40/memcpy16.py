"""References for a 16 MiB get (medians of 10): memmove into a warm buffer, numpy tobytes
into a new bytes object, XXH3 over 16 MiB in 64 KiB chunks from DRAM, and XXH3 of a
256 KiB piece held in L2 (64 times, 16 MiB in all).
Usage: .venv/bin/python docs/data/issue16_s40/memcpy16.py"""
import ctypes
import os
import time

import numpy as np
import xxhash

MiB = 1 << 20
src = np.frombuffer(os.urandom(16 * MiB), dtype=np.uint8).copy()
dst = np.zeros(16 * MiB, dtype=np.uint8)


def median_ms(f, n=10):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2] * 1e3


mv, small = memoryview(src), memoryview(src[:256 * 1024])
print("memmove 16 MiB into a warm buffer %.2f ms"
      % median_ms(lambda: ctypes.memmove(dst.ctypes.data, src.ctypes.data, 16 * MiB)))
print("tobytes 16 MiB into a new object %.2f ms" % median_ms(src.tobytes))
print("xxh3 16 MiB in 64 KiB chunks, from DRAM %.2f ms" % median_ms(
    lambda: [xxhash.xxh3_64_digest(mv[o:o + 65536]) for o in range(0, 16 * MiB, 65536)]))
print("xxh3 of a 256 KiB piece in L2, 64 times %.2f ms" % median_ms(
    lambda: [xxhash.xxh3_64_digest(small[o:o + 65536])
             for _ in range(64) for o in range(0, 256 * 1024, 65536)]))
