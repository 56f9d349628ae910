"""Issue 17, end to end with real processes (a master, a store server, clients here): a byte
flipped in a DRAM replica's segment memory is never returned. Every read path — ``get``,
``batch_get``, ``get_into``, ``batch_get_into``, ranged reads (``open_reads``) and the
Mooncake-compat facade — falls over to the intact replica, or fails naming the key
(``CHECKSUM_MISMATCH``, Mooncake code -801) when there is none."""

from __future__ import annotations

import numpy as np
import pytest

from pymooncake.store.checksum import CHUNK
from pymooncake.store.config import ReplicateConfig
from pymooncake.store.errors import ErrorCode, StoreError

from .procs import MiB

pytestmark = pytest.mark.integration

SIZE = 3 * CHUNK + 1000  # four checksum chunks, the last one short
FLIP = CHUNK + 17  # a byte of the second chunk


def _value(seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8).tobytes()


def _flip(holder, key: str, at: int) -> None:
    """Invert byte ``at`` of ``key``'s replica in ``holder``'s own segment memory."""
    rep = next(r for r in holder.replica_list(key).replicas
               if r.segment == holder.segment_name)
    view = holder._local_view(rep.addr, SIZE)
    view[at] ^= 0xFF


def _corrupt_error(e: object, key: str) -> None:
    assert isinstance(e, StoreError), e
    assert e.code == ErrorCode.CHECKSUM_MISMATCH and e.status == "INTEGRITY_ERROR"
    assert repr(key) in str(e)


def test_corrupt_dram_replica_falls_over_or_fails_on_every_read_path(cluster_factory) -> None:
    cl = cluster_factory()
    server = cl.store_server(8 * MiB)
    holder = cl.client(global_segment_size=4 * MiB)  # holds replicas in this process
    reader = cl.client()  # no segment: every read crosses the Transfer Engine
    good, lone = _value(1), _value(2)
    # "two": one replica in the holder's segment and one in the store server's
    holder.put("two", good, ReplicateConfig(replica_num=2,
                                            preferred_segment=holder.segment_name))
    segs = {r.segment for r in holder.replica_list("two").replicas}
    assert segs == {holder.segment_name, server.info["segment"]}
    holder.put("lone", lone, ReplicateConfig(preferred_segment=holder.segment_name))
    assert {r.segment for r in holder.replica_list("lone").replicas} == {holder.segment_name}
    assert holder.get("two") == good and reader.get("lone") == lone  # intact: readable
    _flip(holder, "two", FLIP)
    _flip(holder, "lone", FLIP)

    # the holder reads its own (corrupt) replica first: it falls over to the server's
    for _ in range(3):
        assert holder.get("two") == good
        assert reader.get("two") == good
    assert holder.batch_get(["two", "two"]) == [good, good]
    buf = np.zeros(2 * SIZE, dtype=np.uint8)
    base = holder.register_buffer(buf)
    assert holder.get_into("two", base, SIZE) == SIZE
    assert buf[:SIZE].tobytes() == good
    rbuf = np.zeros(2 * SIZE, dtype=np.uint8)
    rbase = reader.register_buffer(rbuf)
    assert reader.batch_get_into(["two"], [rbase], [SIZE]) == [SIZE]
    assert rbuf[:SIZE].tobytes() == good

    # one replica, corrupt: an error naming the key on every path, never the bytes
    for c in (holder, reader):
        with pytest.raises(StoreError) as ei:
            c.get("lone")
        _corrupt_error(ei.value, "lone")
        v, w = c.batch_get(["lone", "two"])
        _corrupt_error(v, "lone")
        assert w == good
    (e,) = holder.batch_get_into(["lone"], [base], [SIZE])
    _corrupt_error(e, "lone")
    with pytest.raises(StoreError) as ei:
        reader.get_into("lone", rbase, SIZE)
    _corrupt_error(ei.value, "lone")

    # ranged reads (a layer-wise KV load): per-chunk checksums — a range over the corrupt
    # chunk fails, ranges elsewhere (aligned or not) read fine; "two" falls over
    for c, b, arr in ((holder, base, buf), (reader, rbase, rbuf)):
        arr[:] = 0
        r = c.open_reads(["lone", "two"])
        out = r.read([(0, 0, CHUNK, b), (0, 2 * CHUNK + 5, 300, b + CHUNK),
                      (0, CHUNK + 10, 20, b + 2 * CHUNK), (1, 100, SIZE - 100, b + SIZE)])
        assert out[0] is None and out[1] is None and out[3] is None
        _corrupt_error(out[2], "lone")
        assert arr[:CHUNK].tobytes() == lone[:CHUNK]
        assert arr[CHUNK:CHUNK + 300].tobytes() == lone[2 * CHUNK + 5:2 * CHUNK + 305]
        assert arr[2 * CHUNK:2 * CHUNK + 20].tobytes() == bytes(20)  # never written
        assert arr[SIZE:2 * SIZE - 100].tobytes() == good[100:]
        r.close()


def test_compat_facade_reads_answer_minus_801_for_a_corrupt_replica(cluster_factory) -> None:
    from pymooncake.store.compat import MooncakeDistributedStore

    cl = cluster_factory()  # no store server: the compat store's segment holds the value
    store = MooncakeDistributedStore()
    assert store.setup("localhost", cl.metadata_url, 8 * MiB, 8 * MiB, "tcp", "",
                       cl.master_addr) == 0
    try:
        value = _value(3)
        assert store.put("k", value) == 0
        assert store.get("k") == value
        _flip(store.client, "k", SIZE - 1)  # the last byte (short last chunk)
        assert store.get("k") == b""  # Mooncake's get: empty bytes on any error
        buf = np.zeros(SIZE, dtype=np.uint8)
        ptr = buf.ctypes.data
        assert store.register_buffer(ptr, SIZE) == 0
        assert store.get_into("k", ptr, SIZE) == int(ErrorCode.CHECKSUM_MISMATCH) == -801
        assert store.batch_get_into(["k"], [ptr], [SIZE]) == [-801]
    finally:
        store.close()


def test_replica_copies_are_verified_and_never_copy_corrupt_bytes(cluster_factory) -> None:
    """The master's replica copies (hot-block replication's ``replicate``) check the
    source's bytes before writing them, and a copy is verified on read like any replica."""
    cl = cluster_factory()
    server = cl.store_server(8 * MiB)
    seg = server.info["segment"]
    holder = cl.client(global_segment_size=4 * MiB)
    reader = cl.client()
    good, other = _value(4), _value(5)
    for k, v in (("k", good), ("c", other)):
        holder.put(k, v, ReplicateConfig(preferred_segment=holder.segment_name))
    assert holder._master("replicate", {"keys": ["k"], "segment": seg}) == [{"r": SIZE}]
    assert {r.segment for r in reader.replica_list("k").replicas} == {holder.segment_name,
                                                                       seg}
    _flip(holder, "k", 5)  # the original goes bad: every read falls over to the copy
    for _ in range(3):
        assert holder.get("k") == good and reader.get("k") == good
    _flip(holder, "c", 5)  # a corrupt source: nothing is copied
    (res,) = holder._master("replicate", {"keys": ["c"], "segment": seg})
    assert res["e"][0] == int(ErrorCode.CHECKSUM_MISMATCH) and "'c'" in res["e"][1]
    assert {r.segment for r in reader.replica_list("c").replicas} == {holder.segment_name}
    with pytest.raises(StoreError) as ei:
        reader.get("c")
    _corrupt_error(ei.value, "c")
