"""Issue 17, in-process: the per-chunk checksum (``store.checksum``), the master keeping it
with the object (``put_end``, read answers, the HA journal) and refusing a malformed one."""

from __future__ import annotations

import os
import threading
import time

import blake3
import numpy as np
import pytest
import xxhash

from pymooncake.store import checksum as checksum_mod
from pymooncake.store.checksum import (
    CHUNK,
    COPY_PIECE,
    DIGEST,
    FUSED_MIN,
    PARALLEL_MIN,
    checksum_len,
    chunk_span,
    copy_verified,
    digests,
    digests_begin,
    n_chunks,
    verify,
    well_formed,
)
from pymooncake.store.config import MasterConfig, ReplicateConfig
from pymooncake.store.errors import ErrorCode, StoreError
from pymooncake.store.master.core import MasterCore
from pymooncake.store.master.journal import MetaIndex, encode_entry, restore, take_changes

SIZE = 3 * CHUNK + 1000


def _value(seed: int = 0, n: int = SIZE) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_digests_are_an_algorithm_byte_and_xxh3_64_per_64k_chunk() -> None:
    # XXH3-64's published value for b"": 2d06800538d394c2 (seed 0), big-endian
    assert digests(b"").hex() == "01" + "2d06800538d394c2"
    v = _value()
    want = b"\x01"
    for off in (0, 65536, 131072, 196608):  # by hand: four chunks, the last 1000 bytes
        want += xxhash.xxh3_64(v[off:off + 65536]).digest()
    assert (CHUNK, DIGEST, n_chunks(SIZE), checksum_len(SIZE)) == (65536, 8, 4, 33)
    assert digests(v) == want and len(want) == 33
    assert digests(np.frombuffer(v, dtype=np.uint8)) == want  # any buffer
    assert well_formed(want, SIZE) and not well_formed(want[:-2], SIZE)
    assert not well_formed(b"\x02" + want[1:], SIZE)  # an unknown algorithm byte


def _blake3_checksum(v: bytes) -> bytes:
    """A checksum as written before XXH3: BLAKE3 per chunk, 8 bytes, no algorithm byte."""
    return b"".join(blake3.blake3(v[o:o + CHUNK]).digest()[:8] for o in range(0, len(v), CHUNK))


def test_checksums_written_before_xxh3_verify_with_blake3() -> None:
    v = _value(3)
    old = _blake3_checksum(v)
    assert len(old) == 32 and well_formed(old, SIZE)
    assert verify(v, old) and verify(v[CHUNK:3 * CHUNK], old, CHUNK)
    bad = bytearray(v)
    bad[2 * CHUNK + 7] ^= 0x10
    assert not verify(bad, old) and not verify(bad[CHUNK:3 * CHUNK], old, CHUNK)
    assert not verify(v, digests(v)[1:])  # XXH3 digests without their byte: not BLAKE3's


def test_verify_whole_and_chunk_ranges_and_every_flip() -> None:
    v = _value(1)
    s = digests(v)
    assert verify(v, s)
    assert verify(v[CHUNK:3 * CHUNK], s, CHUNK)  # chunks 1-2
    assert verify(v[3 * CHUNK:], s, 3 * CHUNK)  # the short last chunk
    assert not verify(v[CHUNK:3 * CHUNK], s, 0)  # the right bytes at the wrong place
    assert not verify(v[:-1], s)  # a missing byte is an error, never data
    for at in (0, CHUNK - 1, CHUNK, 2 * CHUNK + 5, SIZE - 1):
        bad = bytearray(v)
        bad[at] ^= 0x01
        assert not verify(bad, s), at
    assert not verify(v, None)  # stored without a checksum: never verifies
    with pytest.raises(ValueError, match="not a multiple of 65536"):
        verify(v[10:CHUNK], s, 10)


@pytest.mark.parametrize("n", [1000, SIZE, FUSED_MIN, FUSED_MIN + 3 * COPY_PIECE + 777])
def test_copy_verified_copies_exactly_and_refuses_any_flip(n: int) -> None:
    """``copy_verified``: a new ``bytes`` equal to the source when it matches its checksum
    (whole-copy path below ``FUSED_MIN``, piece by piece from it on), None after a flipped
    byte in any piece (first, middle, the short last one) or without a checksum."""
    src = np.frombuffer(bytearray(_value(n, n)), dtype=np.uint8)
    s = digests(src.tobytes())
    addr = src.ctypes.data
    out = copy_verified(addr, n, s)
    assert out == src.tobytes() and type(out) is bytes
    assert copy_verified(addr, n, None) is None
    for at in (0, n // 2, n - 1):
        src[at] ^= 0x01
        assert copy_verified(addr, n, s) is None, at
        src[at] ^= 0x01
    assert copy_verified(addr, n, s) == src.tobytes()


@pytest.mark.parametrize("n", [1000, PARALLEL_MIN - 1, PARALLEL_MIN, 3 * PARALLEL_MIN + 99])
def test_digests_begin_equals_digests_and_hashes_large_values_on_the_helper(n: int) -> None:
    """``digests_begin(buf)()`` is ``digests(buf)`` (XXH3-64 per chunk, checked against
    xxhash directly); from ``PARALLEL_MIN`` on the hash runs on the ``pmk-checksum``
    thread, below it on the caller's."""
    buf = _value(n + 1, n)
    seen: list[str] = []
    real = checksum_mod._chunk_digests
    checksum_mod._chunk_digests = lambda mv: (seen.append(threading.current_thread().name),
                                              real(mv))[1]
    try:
        got = digests_begin(buf)()
    finally:
        checksum_mod._chunk_digests = real
    want = bytes([1]) + b"".join(xxhash.xxh3_64_digest(buf[o:o + CHUNK])
                                 for o in range(0, n, CHUNK))
    assert got == want == digests(buf)
    assert len(seen) == 1
    assert seen[0].startswith("pmk-checksum") == (n >= PARALLEL_MIN), seen


def test_checksum_helper_works_in_a_forked_child() -> None:
    """A child forked after the helper thread started gets its own helper (the parent's
    thread does not exist there): its large hash (on that helper) finishes and is right,
    and so is its verified copy (on the child's own thread)."""
    n = PARALLEL_MIN + CHUNK
    buf = _value(7, n)
    want = digests_begin(buf)()  # the parent's helper is running now
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only when both answers are right, never return
        ok = False
        try:
            src = np.frombuffer(bytearray(buf), dtype=np.uint8)
            ok = (digests_begin(buf)() == want
                  and copy_verified(src.ctypes.data, n, want) == buf)
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's checksum did not finish in 20 s")


@pytest.mark.parametrize(("off", "n", "span"), [
    (0, CHUNK, (0, 65536)), (5, 10, (0, 65536)), (65535, 2, (0, 131072)),
    (2 * CHUNK + 5, 300, (131072, 196608)), (3 * CHUNK + 10, 990, (196608, SIZE)),
    (100, SIZE - 100, (0, SIZE))])
def test_chunk_span_covers_a_range_with_whole_chunks(off, n, span) -> None:
    assert chunk_span(off, n, SIZE) == span


def _core() -> MasterCore:
    core = MasterCore(MasterConfig(seed=1))
    core.objects.changed, core.segments_changed = set(), set()
    core.mount_segment("c1", "S1", "h1", 1 << 20, 64 << 20, 0.0)
    return core


def test_master_keeps_the_writers_checksum_and_refuses_a_malformed_one() -> None:
    core = _core()
    v = _value(2)
    obj = core.start_write("c1", "k", SIZE, ReplicateConfig(), 1.0)
    for bad, words in ((b"x" * 31, r"must be 33 bytes \(XXH3-64\) or 32 \(BLAKE3, before XXH3\) "
                                   "for 197608 bytes of value, got 31 bytes"),
                       (b"\x02" + b"x" * 32, "got 33 bytes"), ("text", "got str")):
        with pytest.raises(StoreError, match=words) as e:
            core.put_end("c1", "k", obj.generation, 2.0, bad)  # type: ignore[arg-type]
        assert e.value.code == ErrorCode.INVALID_PARAMS
    with pytest.raises(StoreError) as e:  # still unpublished
        core.get_replica_list("c1", "k", 3.0)
    assert e.value.code == ErrorCode.REPLICA_IS_NOT_READY
    core.put_end("c1", "k", obj.generation, 4.0, digests(v))
    obj2 = core.start_write("c1", "k-old", SIZE, ReplicateConfig(), 4.5)
    core.put_end("c1", "k-old", obj2.generation, 4.6, _blake3_checksum(v))  # an old writer
    assert core.get_replica_list("c1", "k", 5.0).checksum == digests(v)

    # the HA journal carries it: a new leader answers readers with the same value
    idx = MetaIndex()
    ops = take_changes(core)
    idx.apply(1, encode_entry(1, ops))
    new = MasterCore(MasterConfig())
    assert restore(idx, new, 1_000_000.0).objects == 2
    assert new.get_replica_list("c1", "k", 1_000_001.0).checksum == digests(v)
    assert new.get_replica_list("c1", "k-old", 1_000_001.0).checksum == _blake3_checksum(v)
