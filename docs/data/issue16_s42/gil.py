"""Does xxhash release the GIL? XXH3 over one warm 16 MiB buffer (medians of 15): in 64 KiB
chunks on one thread, then split in two halves hashed by two threads at once; and the
same as one call per half (inputs that large are hashed without the GIL).
Usage: .venv/bin/python docs/data/issue16_s42/gil.py (output: gil.txt)"""
import os, time, numpy as np, xxhash, ctypes
from concurrent.futures import ThreadPoolExecutor
import pymooncake.store.checksum as ck
MiB=1<<20; SZ=16*MiB
b=np.frombuffer(os.urandom(SZ),dtype=np.uint8).copy(); mv=memoryview(b)
pool=ThreadPoolExecutor(1)
def med(f,n=15):
    ts=[]
    for _ in range(n):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return sorted(ts)[n//2]*1e3
h=SZ//2
print("1 thread hash 16 MiB %.2f"%med(lambda: ck._chunk_digests(mv)))
def two():
    f=pool.submit(ck._chunk_digests, mv[h:]); ck._chunk_digests(mv[:h]); f.result()
print("2 threads hash 8+8 MiB %.2f"%med(two))
print("1 call xxh3 16MiB %.2f"%med(lambda: xxhash.xxh3_64_digest(mv)))
def two1():
    f=pool.submit(xxhash.xxh3_64_digest, mv[h:]); xxhash.xxh3_64_digest(mv[:h]); f.result()
print("2 threads 1 call each %.2f"%med(two1))
print(xxhash.VERSION if hasattr(xxhash,'VERSION') else xxhash.__version__)
