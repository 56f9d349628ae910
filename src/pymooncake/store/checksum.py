"""Per-chunk checksums of Store objects, verified on every read from every tier (issue 17).

The project's rule: every stored byte carries a checksum, verified on read; a corrupt or
missing byte is an error, never data. At put the client hashes the object's bytes in
``CHUNK``-byte chunks and sends the chunks' digests with ``put_end``; the master keeps them
with the object's metadata, so every replica — the writer's DRAM copies, the SSD copy
loaded back, copies made by hot-block replication or copy/move tasks — is checked against
the same value. Per-chunk (not one whole-object) digests let a ranged read (a layer-wise KV
load of layers ``[a, b)`` of a block object) verify just the chunks it covers: a range that
starts on a chunk boundary and ends on one (or at the object's end) is verified in place;
any other range is widened to whole chunks by the reader.

A checksum is self-describing: one algorithm byte (``XXH3_64``: each chunk's XXH3-64
digest, 8 bytes big-endian; 4-8x less CPU per byte than BLAKE3 on this project's machine,
docs/benchmarks.md) then ``DIGEST`` bytes per chunk. A value with no algorithm byte
(``n_chunks * DIGEST`` bytes) is a checksum written before the switch (BLAKE3 cut to 8
bytes per chunk; old clients, HA journals and snapshots) and is verified with BLAKE3. This
module is the only place that knows the algorithms: everything else stores, sends and
compares checksums as opaque bytes.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import blake3
import xxhash

CHUNK = 64 * 1024
"""Bytes per checksummed chunk (the last chunk of an object may be shorter)."""
DIGEST = 8
"""Bytes of each chunk's digest (64 bits: a corrupt chunk passes with probability
2**-64)."""
XXH3_64 = 1
"""The algorithm byte of the checksums written now: XXH3-64 per chunk."""
_TAG = bytes([XXH3_64])
_xxh3 = xxhash.xxh3_64_digest


def n_chunks(size: int) -> int:
    """Chunks of an object of ``size`` bytes."""
    return (size + CHUNK - 1) // CHUNK


def checksum_len(size: int) -> int:
    """Bytes of the checksum ``digests`` returns for an object of ``size`` bytes."""
    return 1 + n_chunks(size) * DIGEST


def well_formed(checksum: object, size: int) -> bool:
    """Whether ``checksum`` can be the checksum of ``size`` bytes: ``bytes`` of this
    module's current form (algorithm byte + digests) or of the pre-XXH3 BLAKE3 form."""
    if not isinstance(checksum, bytes):
        return False
    n = len(checksum)
    return (n == checksum_len(size) and checksum[0] == XXH3_64) or n == n_chunks(size) * DIGEST


def describe(size: int) -> str:
    """The accepted lengths, for an error message."""
    return (f"{checksum_len(size)} bytes (XXH3-64) or {n_chunks(size) * DIGEST} "
            f"(BLAKE3, before XXH3) for {size} bytes of value")


def _chunk_digests(mv: memoryview) -> bytes:
    n = mv.nbytes
    if n <= CHUNK:
        return _xxh3(mv)
    return b"".join([_xxh3(mv[off:off + CHUNK]) for off in range(0, n, CHUNK)])


def _blake3_digests(mv: memoryview) -> bytes:
    n = mv.nbytes
    if n <= CHUNK:
        return blake3.blake3(mv).digest(DIGEST)
    return b"".join([blake3.blake3(mv[off:off + CHUNK]).digest(DIGEST)
                     for off in range(0, n, CHUNK)])


def digests(buf: memoryview | bytes | bytearray) -> bytes:
    """The checksum of ``buf``'s bytes, hashed in place: the algorithm byte, then
    ``DIGEST`` bytes per ``CHUNK``-byte chunk, in order (``checksum_len(len)`` bytes)."""
    return _TAG + _chunk_digests(memoryview(buf).cast("B"))


PARALLEL_MIN = 4 << 20
"""Values from this size (4 MiB) on are hashed on the checksum helper thread while the
caller copies them (a put's ``digests_begin``): XXH3 over a whole value and ``memmove`` run
without the GIL, so the two use two cores. Smaller values (KV blocks are 0.7 MiB) stay on
the caller's thread. A get's ``copy_verified`` stays on one thread at every size: it
hashes 64 KiB chunks, and xxhash keeps the GIL for those (two threads hashing 8 MiB each
that way took 0.99 ms against 0.51 for one thread doing all 16), so a second thread doing
half the work gained nothing: a 16 MiB embedded get took a median 5.48 ms a round split
against 5.13 on one thread (and more CPU in session 40; docs/benchmarks.md, issue 16
session 42)."""
_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_pool_lock = threading.Lock()


def _helper() -> ThreadPoolExecutor:
    """The process's checksum helper (one thread, started on first use; a forked child
    starts its own: the parent's thread does not exist there)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(1, thread_name_prefix="pmk-checksum")
            _pool_pid = os.getpid()
        return _pool


def digests_begin(buf: memoryview | bytes | bytearray) -> Callable[[], bytes]:
    """Start ``digests(buf)``; call the result for the checksum. From ``PARALLEL_MIN``
    bytes on the hashing runs on the helper thread, so a caller that copies ``buf``
    meanwhile (a put into its segment or onto the wire) spends max(copy, hash), not the
    sum: a 16 MiB put here, 2.0 ms serial against 1.4 ms overlapped. ``buf`` must not
    change until the result has been called."""
    if memoryview(buf).nbytes < PARALLEL_MIN:
        value = digests(buf)
        return lambda: value
    fut: Future[bytes] = _helper().submit(digests, buf)
    return fut.result


def view_at(addr: int, length: int) -> memoryview:
    """A writable view of ``length`` bytes at raw address ``addr`` (registered memory)."""
    return memoryview((ctypes.c_char * length).from_address(addr)).cast("B")


def chunk_span(off: int, length: int, size: int) -> tuple[int, int]:
    """The whole-chunk byte range ``[start, end)`` covering ``[off, off+length)`` of an
    object of ``size`` bytes (``end`` is at most ``size``)."""
    start = off - off % CHUNK
    end = min(size, -(-(off + length) // CHUNK) * CHUNK)
    return start, end


def verify(buf: memoryview | bytes | bytearray, checksum: bytes | None,
           start: int = 0) -> bool:
    """Whether ``buf`` — bytes ``[start, start+len)`` of an object, ``start`` a multiple of
    ``CHUNK`` and the length whole chunks or up to the object's end — matches the object's
    ``checksum`` (hashed in place, with the checksum's own algorithm). ``checksum=None``
    (an object stored without one) fails: unverifiable bytes are never data."""
    if checksum is None:
        return False
    if start % CHUNK:
        raise ValueError(f"verify: start {start} is not a multiple of {CHUNK}")
    mv = memoryview(buf).cast("B")
    lo = start // CHUNK * DIGEST
    hi = lo + n_chunks(mv.nbytes) * DIGEST
    if len(checksum) % DIGEST == 1 and checksum[0] == XXH3_64:
        return _chunk_digests(mv) == checksum[1 + lo:1 + hi]
    if len(checksum) % DIGEST == 0:  # before XXH3: BLAKE3 per chunk, no algorithm byte
        return _blake3_digests(mv) == checksum[lo:hi]
    return False


def verify_at(addr: int, length: int, checksum: bytes | None, start: int = 0) -> bool:
    """``verify`` of ``length`` bytes at raw address ``addr``."""
    return verify(view_at(addr, length), checksum, start)


COPY_PIECE = 4 * CHUNK
"""Bytes ``copy_verified`` copies before hashing them (256 KiB: still in L2 when hashed)."""
FUSED_MIN = 16 * COPY_PIECE
"""Values from this size (4 MiB) on are copied and hashed piece by piece; smaller ones are
copied whole, then hashed (both fit in cache: nothing to gain)."""
_new_bytes = None
_BYTES_DATA = bytes.__basicsize__ - 1  # CPython: offset of a bytes object's data
if sys.implementation.name == "cpython":
    _new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
    _new_bytes.restype = ctypes.py_object
    _new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)


def copy_verified(addr: int, length: int, checksum: bytes | None) -> bytes | None:
    """A new ``bytes`` holding the ``length`` bytes at raw address ``addr`` (a whole object)
    if they match ``checksum``, else None (corrupt, or no checksum). From ``FUSED_MIN``
    bytes on, each ``COPY_PIECE`` is hashed from the new object right after its copy, while
    it is still in cache, instead of a second pass over the source (a 16 MiB value here:
    2.5 -> 2.3 ms); the object is filled through CPython's ``PyBytes_FromStringAndSize(NULL,
    n)``, the C API's create-then-fill, and is not visible to anyone before it is full."""
    if length < FUSED_MIN or _new_bytes is None or checksum is None:
        value = ctypes.string_at(addr, length)
        return value if verify(value, checksum) else None
    out = _new_bytes(None, length)
    dst = id(out) + _BYTES_DATA
    mv = memoryview(out)
    for off in range(0, length, COPY_PIECE):
        n = min(COPY_PIECE, length - off)
        ctypes.memmove(dst + off, addr + off, n)
        if not verify(mv[off:off + n], checksum, off):
            return None
    return out
