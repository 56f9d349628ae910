"""Embedded 16 MiB Store gets in-process: wall, CPU and page faults per get, the time inside
checksum.copy_verified, and a fresh 16 MiB bytes allocation for comparison. Env: NOPAR=1
keeps the copy on one thread (PARALLEL_MIN out of reach); PIECE=KiB sets COPY_PIECE.
Usage: [NOPAR=1] [PIECE=256] .venv/bin/python docs/data/issue16_s40/get16.py"""
import resource, time, sys, os
from pymooncake.bench.store_procs import _pymooncake_cluster
from pymooncake.store.client import StoreClient
from pymooncake.transfer import TransferConfig
MiB = 1 << 20
import pymooncake.store.checksum as ck
if os.environ.get("NOPAR"): ck.PARALLEL_MIN = 1 << 40
import pymooncake.store.client_get as cg
_cv = ck.copy_verified
T = [0.0, 0]
def timed(*a):
    t = time.perf_counter(); r = _cv(*a); T[0] += time.perf_counter() - t; T[1] += 1; return r
cg.copy_verified = timed
if os.environ.get("PIECE"): ck.COPY_PIECE = int(os.environ["PIECE"]) << 10
seg = 256 * MiB
with _pymooncake_cluster(0) as (addr, md, _):
    c = StoreClient(addr, md, global_segment_size=seg, local_buffer_size=33 * MiB,
                    transfer_config=TransferConfig(transports=("local", "tcp"))).start()
    try:
        v = os.urandom(16 * MiB)
        for i in range(8): c.put(f"k{i}", v)
        for rnd in range(3):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter(); c0 = time.process_time()
            for i in range(8): x = c.get(f"k{i}"); del x
            t1 = time.perf_counter(); c1 = time.process_time()
            f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            print("copy_verified %.2f ms avg over %d" % (T[0] / max(1, T[1]) * 1e3, T[1])); T[:] = [0.0, 0]
            print("get: %.2f ms wall, %.2f ms cpu, %d faults per get" % ((t1-t0)/8e-3, (c1-c0)/8e-3, (f1-f0)/8))
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            for i in range(8): x = bytes(bytearray(16 * MiB)); del x
            t1 = time.perf_counter()
            f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            print("  alloc+zero bytes: %.2f ms, %d faults" % ((t1-t0)/8e-3, (f1-f0)/8))
    finally:
        c.close()
