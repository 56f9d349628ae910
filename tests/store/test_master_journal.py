"""The HA master's journal, pure: entries applied in order, bad records skipped and
reported, gaps refused, restore with overlapping records (BUG-58), snapshots."""

from __future__ import annotations

import msgpack
import pytest

from pymooncake.store.config import MasterConfig, ReplicateConfig
from pymooncake.store.errors import ErrorCode, StoreError
from pymooncake.store.leader import MasterLocator
from pymooncake.store.master.core import MasterCore
from pymooncake.store.master.ha import HaConfig, leader_address
from pymooncake.store.master.journal import (
    DROP_OVERLAP,
    SKIP_MALFORMED,
    SKIP_UNDECODABLE,
    LogGap,
    MetaIndex,
    encode_entry,
    restore,
    take_changes,
)

KiB = 1 << 10


def _leader(n_objects: int = 10) -> tuple[MasterCore, MetaIndex]:
    """A tracking core with two segments and ``n_objects`` published 64 KiB objects plus
    one unfinished write, journaled entry by entry into an index."""
    core = MasterCore(MasterConfig(seed=1))
    core.objects.changed, core.segments_changed = set(), set()
    idx = MetaIndex()

    def flush() -> None:
        ops = take_changes(core)
        if ops:
            idx.apply(idx.applied_seq + 1, encode_entry(idx.applied_seq + 1, ops))

    core.mount_segment("c1", "S1", "h1", 1 << 20, 64 << 20, 0.0)
    core.mount_segment("c2", "S2", "h2", 1 << 30, 64 << 20, 0.0)
    flush()
    for i in range(n_objects):
        obj = core.start_write("c1", f"k_{i}", 64 * KiB, ReplicateConfig(), 1.0)
        flush()
        core.put_end("c1", f"k_{i}", obj.generation, 2.0)
        flush()
    core.start_write("c2", "unfinished", 64 * KiB, ReplicateConfig(), 3.0)
    flush()
    return core, idx


def test_restore_loads_every_published_object_at_its_offsets() -> None:
    core, idx = _leader()
    new = MasterCore(MasterConfig())
    rep = restore(idx, new, 1_000_000.0)
    assert (rep.objects, rep.segments, rep.dropped) == (10, 2, [])
    # restored objects are leased afresh: not evictable before old readers are done
    assert new.lease_count("k_0", 1_000_000.0 + 9_999) == 1
    assert new.lease_count("k_0", 1_000_000.0 + 10_001) == 0
    assert rep.discarded_writes == ["unfinished"]
    for i in range(10):
        a = core.get_replica_list("c1", f"k_{i}", 5.0)
        b = new.get_replica_list("c1", f"k_{i}", 1_000_001.0)
        assert (a.generation, a.replicas) == (b.generation, b.replicas)
    # the unfinished write: not readable, its range still taken, its put_end retryable
    with pytest.raises(StoreError) as e:
        new.get_replica_list("c2", "unfinished", 1_000_001.0)
    assert e.value.code == ErrorCode.OBJECT_NOT_FOUND
    gen = core.objects.get("unfinished").generation
    with pytest.raises(StoreError) as e:
        new.put_end("c2", "unfinished", gen, 1_000_002.0)
    assert e.value.code == ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS and e.value.retryable
    assert new.pool.used_bytes() == core.pool.used_bytes() == 11 * 64 * KiB
    # the clients are known (no re-mount), new generations above every journaled one
    assert new.heartbeat("c1", 1_000_003.0) and new.heartbeat("c2", 1_000_003.0)
    obj = new.start_write("c1", "fresh", 64 * KiB, ReplicateConfig(), 1_000_004.0)
    assert obj.generation > gen
    # put_end of a published object by its writer is idempotent (a retried answer)
    new.put_end("c1", "k_3", core.objects.get("k_3").generation, 1_000_005.0)


def test_overlapping_records_are_both_dropped_and_the_rest_load() -> None:
    core, idx = _leader(300)
    k7 = idx.objects["k_7"]
    bad = dict(k7, key="k_bad", gen=10_000)  # a put-end claiming k_7's offsets in S1
    idx.apply(idx.applied_seq + 1, encode_entry(idx.applied_seq + 1, [["obj", bad]]))
    new = MasterCore(MasterConfig())
    rep = restore(idx, new, 0.0)
    assert sorted(rep.dropped) == [("k_7", DROP_OVERLAP), ("k_bad", DROP_OVERLAP)]
    assert rep.objects == 299
    for key in ("k_7", "k_bad"):
        with pytest.raises(StoreError) as e:
            new.get_replica_list("c", key, 1.0)
        assert e.value.code == ErrorCode.OBJECT_NOT_FOUND
    # new objects never land on a restored object's range
    taken = {(r.segment, r.addr) for o in new.objects for r in o.replicas}
    for i in range(20):
        o = new.start_write("c1", f"new_{i}", 64 * KiB, ReplicateConfig(), 2.0)
        for r in o.replicas:
            assert all(not (r.segment == s and abs(r.addr - a) < 64 * KiB) for s, a in taken)


def test_bad_records_are_skipped_and_reported_gaps_are_refused() -> None:
    _, idx = _leader(5)
    n = idx.applied_seq
    idx.apply(n + 1, b"\xc1 not msgpack")
    idx.apply(n + 2, encode_entry(n + 2, [["obj", {"key": "x"}], ["frob", 1],
                                          ["del", "k_0"]]))
    idx.apply(n + 3, encode_entry(n + 99, []))  # an entry stored under the wrong number
    assert [r for _, r, _ in idx.skipped] == [SKIP_UNDECODABLE, SKIP_MALFORMED,
                                              SKIP_MALFORMED, SKIP_UNDECODABLE]
    assert idx.applied_seq == n + 3 and "k_0" not in idx.objects and "k_1" in idx.objects
    with pytest.raises(LogGap):
        idx.apply(n + 5, encode_entry(n + 5, []))
    with pytest.raises(LogGap):
        idx.apply(n + 4, None)
    assert idx.applied_seq == n + 3


def test_snapshot_round_trip_and_a_bad_chunk() -> None:
    _, idx = _leader(50)
    chunks = idx.snapshot_chunks(max_chunk_bytes=KiB)
    assert len(chunks) > 3
    other = MetaIndex()
    other.load_snapshot(idx.applied_seq, chunks)
    assert (other.objects, other.segments) == (idx.objects, idx.segments)
    broken = MetaIndex()
    broken.load_snapshot(7, [chunks[0], b"garbage", *chunks[2:]])
    assert broken.applied_seq == 7 and [r for _, r, _ in broken.skipped] == [SKIP_UNDECODABLE]
    assert 0 < len(idx.objects) - len(broken.objects) < 50


def test_ha_config_and_master_addresses_are_checked() -> None:
    with pytest.raises(ValueError, match="lease_ttl_s"):
        HaConfig("etcd://127.0.0.1:2379", lease_ttl_s=0.5)
    with pytest.raises(ValueError, match="whole seconds"):   # --ha-lease-ttl 1.5
        HaConfig("etcd://127.0.0.1:2379", lease_ttl_s=1.5)
    assert HaConfig("etcd://127.0.0.1:2379", lease_ttl_s=3.0).lease_ttl_s == 3.0
    with pytest.raises(ValueError, match="cluster_id"):
        HaConfig("etcd://127.0.0.1:2379", cluster_id="a/b")
    loc = MasterLocator("etcd://127.0.0.1:2379/blue")
    assert loc.ha and loc.leader_key == "pymooncake/store/blue/leader"
    loc = MasterLocator("10.0.0.1:5,10.0.0.2:6")
    assert loc.ha and loc.addrs == [("10.0.0.1", 5), ("10.0.0.2", 6)]
    loc.failover(("10.0.0.1", 5))
    assert loc.peek() == ("10.0.0.2", 6)
    loc.failover(("10.0.0.2", 6), hint="10.0.0.9:7")
    assert loc.peek() == ("10.0.0.9", 7)
    assert not MasterLocator("h:1").ha
    for bad in ("", "h", "h:x", "etcd://", "a:1,b"):
        with pytest.raises(ValueError, match="master address"):
            MasterLocator(bad)
    assert leader_address(msgpack.packb({"addr": "h:1", "id": "x"})) == "h:1"
    assert leader_address(b"\xff") is None and leader_address(None) is None
