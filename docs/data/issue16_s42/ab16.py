"""Embedded 16 MiB Store gets in one process, interleaved round by round between ways of
copying an own-segment replica out: ``one`` (checksum.copy_verified today: 256 KiB pieces,
each hashed right after its copy, on the caller's thread), ``split`` (session 40's
copy_verified: the same, with the second half on the checksum helper thread at once),
``pipe2m`` (the helper memmoves 2 MiB pieces while the caller hashes each one behind it),
``whole`` (one ctypes.string_at, then the hash of the new bytes). 16 keys put once; each
round gets all 16, holding the previous value as bench store does, and checks it.
Prints each round's mean ms per get (the bench's throughput is bytes / the sum of them).
Usage: [ROUNDS=8] [ONLY=one,split] .venv/bin/python docs/data/issue16_s42/ab16.py"""
import ctypes
import os
import threading
import time

import pymooncake.store.checksum as ck
import pymooncake.store.client_get as cg
from pymooncake.bench.store_procs import _pymooncake_cluster
from pymooncake.store.client import StoreClient
from pymooncake.transfer import TransferConfig

MiB = 1 << 20
N, SZ = 16, 16 * MiB
one = ck.copy_verified


def _pieces(dst, addr, mv, checksum, start, end):
    for off in range(start, end, ck.COPY_PIECE):
        n = min(ck.COPY_PIECE, end - off)
        ctypes.memmove(dst + off, addr + off, n)
        if not ck.verify(mv[off:off + n], checksum, off):
            return False
    return True


def split(addr, length, checksum):
    if length < ck.FUSED_MIN or checksum is None:
        return one(addr, length, checksum)
    out = ck._new_bytes(None, length)
    dst, mv = id(out) + ck._BYTES_DATA, memoryview(out)
    mid = length // 2 // ck.COPY_PIECE * ck.COPY_PIECE
    rest = ck._helper().submit(_pieces, dst, addr, mv, checksum, mid, length)
    ok = _pieces(dst, addr, mv, checksum, 0, mid)
    return out if rest.result() and ok else None


def _copier(dst, addr, length, piece, sem):
    for off in range(0, length, piece):
        ctypes.memmove(dst + off, addr + off, min(piece, length - off))
        sem.release()


def pipe2m(addr, length, checksum, piece=2 * MiB):
    if length < ck.FUSED_MIN or checksum is None:
        return one(addr, length, checksum)
    out = ck._new_bytes(None, length)
    dst, mv = id(out) + ck._BYTES_DATA, memoryview(out)
    sem = threading.Semaphore(0)
    fut = ck._helper().submit(_copier, dst, addr, length, piece, sem)
    ok = True
    try:
        for off in range(0, length, piece):
            sem.acquire()
            ok = ok and ck.verify(mv[off:off + piece], checksum, off)
    finally:
        fut.result()
    return out if ok else None


def whole(addr, length, checksum):
    out = ctypes.string_at(addr, length)
    return out if ck.verify(out, checksum) else None


VARS = {"one": one, "split": split, "pipe2m": pipe2m, "whole": whole}
names = (os.environ.get("ONLY") or ",".join(VARS)).split(",")
res = {n: [] for n in names}
with _pymooncake_cluster(0) as (addr, md, _):
    c = StoreClient(addr, md, global_segment_size=320 * MiB, local_buffer_size=33 * MiB,
                    transfer_config=TransferConfig(transports=("local", "tcp"))).start()
    try:
        vals = [os.urandom(SZ) for _ in range(N)]
        for i in range(N):
            c.put(f"k{i}", vals[i])
        for rnd in range(int(os.environ.get("ROUNDS", 8))):
            for n in (names if rnd % 2 == 0 else names[::-1]):
                cg.copy_verified = VARS[n]
                lat, got = [], None
                for i in range(N):
                    t = time.perf_counter()
                    got = c.get(f"k{i}")
                    lat.append(time.perf_counter() - t)
                    assert got == vals[i]
                res[n].append(sum(lat) / N * 1e3)
                del got
    finally:
        c.close()
for n in names:
    xs = sorted(res[n])
    print("%-7s ms per get, by round: %s  median %.2f" % (
        n, " ".join("%.2f" % x for x in res[n]), xs[len(xs) // 2]))
