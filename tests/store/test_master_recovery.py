"""The master's pure rules for holders that rejoin and replicas found bad (issue 17,
``store/master/recovery.py``), with a fake clock and no sockets."""

from __future__ import annotations

from pymooncake.store.checksum import digests
from pymooncake.store.config import MasterConfig, ReplicateConfig
from pymooncake.store.errors import ErrorCode, StoreError
from pymooncake.store.master import recovery
from pymooncake.store.master.core import MasterCore
from pymooncake.store.protocol import TIER_SSD

MiB = 1 << 20
H = "ab" * 16
SIZE = 100_000


def _value(i: int) -> bytes:
    return bytes([i]) * SIZE


def _core(keys: list[str]) -> MasterCore:
    """Segment ``a1`` of holder ``H`` (client c1) holding ``keys`` only on its SSD tier,
    and a DRAM-only segment ``b`` (client c2)."""
    core = MasterCore(MasterConfig())
    core.mount_segment("c1", "a1", "h1", 1 << 32, 16 * MiB, 0.0, 64 * MiB, holder=H)
    core.mount_segment("c2", "b", "h2", 2 << 32, 16 * MiB, 0.0)
    for i, k in enumerate(keys):
        h = core.put_start("c1", k, SIZE, ReplicateConfig(preferred_segment="a1"), 0.0)
        core.put_end("c1", k, h.generation, 0.0, digests(_value(i)))
        core._evict(k, "test")
        (order,) = core.drain_effects().spills
        assert core.spill_done(k, h.generation, "a1", True, now_ms=1.0)
    return core


def _entries(keys: list[str]) -> list[tuple[str, int, bytes]]:
    return [(k, SIZE, digests(_value(i))) for i, k in enumerate(keys)]


def test_takeover_then_rejoin_recreates_each_object_once() -> None:
    keys = ["k0", "k1", "k2"]
    core = _core(keys)
    assert core.ssd_used["a1"] == 3 * SIZE
    # the restarted holder mounts a new segment: its dead life's is dropped at once
    core.mount_segment("c3", "a2", "h1", 3 << 32, 16 * MiB, 2.0, 64 * MiB, holder=H)
    assert "a1" not in core.pool.segments and core.list_keys() == []
    assert set(core.lost_ssd[H]) == set(keys)
    out = recovery.register_ssd(core, "c3", "a2", H, _entries(keys), False, 3.0)
    assert out == [recovery.REGISTERED] * 3
    again = recovery.register_ssd(core, "c3", "a2", H, _entries(keys), True, 4.0)
    assert again == [recovery.REGISTERED] * 3  # idempotent: never a second replica
    assert sorted(core.list_keys()) == keys
    for k in keys:
        reps = core.objects.get(k).replicas
        assert [(r.segment, r.tier, r.complete) for r in reps] == [("a2", TIER_SSD, True)]
    assert core.ssd_used["a2"] == 3 * SIZE and H not in core.lost_ssd


def test_rejoin_refuses_other_bytes_removed_keys_and_strangers() -> None:
    core = _core(["k0", "k1", "k2", "k3"])
    core.tick(core.config.client_ttl_s * 1000.0 + 10.0)  # c1 silent: a1 dropped
    assert "a1" not in core.pool.segments and core.list_keys() == []
    core.mount_segment("c2", "b", "h2", 2 << 32, 16 * MiB, 0.0)  # c2 was dropped too
    try:
        core.remove("k1", 20_000.0)
    except StoreError as e:
        assert e.code == ErrorCode.OBJECT_NOT_FOUND
    h = core.put_start("c2", "k2", 10, ReplicateConfig(), 20_000.0)
    core.put_end("c2", "k2", h.generation, 20_000.0, digests(b"x" * 10))
    core.mount_segment("c3", "a2", "h1", 3 << 32, 16 * MiB, 20_000.0, 64 * MiB, holder=H)
    entries = _entries(["k0", "k1", "k2", "k3"])
    entries[3] = ("k3", SIZE, digests(b"\0" * SIZE))  # a file with other bytes
    entries.append(("never", SIZE, digests(_value(9))))
    out = recovery.register_ssd(core, "c3", "a2", H, entries, True, 20_001.0)
    assert out[0] == recovery.REGISTERED
    assert "does not know" in out[1] and "other bytes" in out[2]
    assert "does not know" in out[3] and "does not know" in out[4]
    assert sorted(core.list_keys()) == ["k0", "k2"]
    assert core.ssd_used["a2"] == SIZE
    for who, seg, holder in (("c2", "a2", H), ("c3", "a2", "cd" * 16), ("c3", "zz", H)):
        try:
            recovery.register_ssd(core, who, seg, holder, [], True, 20_002.0)
            raise AssertionError("accepted")
        except StoreError as e:
            assert e.code in (ErrorCode.ILLEGAL_CLIENT, ErrorCode.SEGMENT_NOT_FOUND)


def test_bad_replica_dropped_but_never_the_last() -> None:
    core = MasterCore(MasterConfig(client_ttl_s=1000.0))
    core.mount_segment("c1", "s1", "h1", 1 << 32, 16 * MiB, 0.0)
    core.mount_segment("c2", "s2", "h2", 2 << 32, 16 * MiB, 0.0)
    h = core.put_start("c1", "k", SIZE, ReplicateConfig(replica_num=2), 0.0)
    core.put_end("c1", "k", h.generation, 0.0, digests(_value(1)))
    r1, r2 = core.objects.get("k").replicas
    used = core.pool.used_bytes()
    assert recovery.drop_bad_replicas(core, "k", h.generation + 1, [r1.replica_id], 1.0) == 0
    assert recovery.drop_bad_replicas(core, "k", h.generation, [r1.replica_id], 1.0) == 1
    assert [r.segment for r in core.objects.get("k").replicas] == [r2.segment]
    assert core.pool.used_bytes() == used  # freed one lease TTL later (a reader may copy)
    core.tick(1.0 + core.config.default_kv_lease_ttl_ms + 1)
    assert core.pool.used_bytes() == used // 2
    assert recovery.drop_bad_replicas(core, "k", h.generation, [r2.replica_id], 2.0) == 0
    assert core.list_keys() == ["k"]
