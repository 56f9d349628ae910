"""The master's pure core with a fake clock: two-phase put, leases, pins, eviction,
writer crashes, stale handles, dead clients (cases BUG-17/18/19/21/33)."""

from __future__ import annotations

import pytest

from pymooncake.store.config import MasterConfig, ReplicateConfig
from pymooncake.store.errors import ErrorCode, StoreError
from pymooncake.store.master.core import MasterCore

MiB = 1 << 20
R1 = ReplicateConfig()


def status(fn, *args, **kw) -> str:
    try:
        fn(*args, **kw)
    except StoreError as e:
        return e.status
    return "OK"


def make(num_segments: int = 1, seg_bytes: int = 16 * MiB, **cfg) -> MasterCore:
    core = MasterCore(MasterConfig(**cfg))
    for i in range(num_segments):
        core.mount_segment(f"c{i}", f"s{i}", f"host{i}", (i + 1) << 32, seg_bytes, 0.0)
    return core


def put(core: MasterCore, key: str, size: int, now: float, client: str = "c0",
        config: ReplicateConfig = R1):
    h = core.put_start(client, key, size, config, now)
    core.put_end(client, key, h.generation, now)
    return h


def test_two_phase_put_visibility() -> None:
    core = make()
    h = core.put_start("c0", "k", 1000, R1, 0.0)
    assert not core.exist("c1", "k", 1.0)
    assert status(core.get_replica_list, "c1", "k", 1.0) == "NOT_READY"
    assert "k" not in core.list_keys()
    core.put_end("c0", "k", h.generation, 2.0)
    assert core.exist("c1", "k", 3.0)
    rl = core.get_replica_list("c1", "k", 3.0)
    assert rl.size_bytes == 1000 and len(rl.replicas) == 1
    assert rl.replicas[0].segment == "s0" and rl.replicas[0].addr == 1 << 32


def test_revoke_frees_space_and_key() -> None:
    core = make()
    h = core.put_start("c0", "k", 1000, R1, 0.0)
    assert core.pool.used_bytes() == 1024  # rounded to 64 bytes
    core.put_revoke("c0", "k", h.generation, 1.0)
    assert core.pool.used_bytes() == 0
    assert status(core.get_replica_list, "c0", "k", 1.0) == "NOT_FOUND"


def test_replicas_on_distinct_segments_and_hosts_best_effort() -> None:
    core = make(num_segments=3)
    h = core.put_start("c0", "k", 100, ReplicateConfig(replica_num=3), 0.0)
    assert sorted(r.segment for r in h.replicas) == ["s0", "s1", "s2"]
    h = core.put_start("c0", "k2", 100, ReplicateConfig(replica_num=5), 0.0)
    assert len({r.segment for r in h.replicas}) == 3  # best effort, like Mooncake


@pytest.mark.parametrize("strategy", ["random", "free_ratio_first", "local_first"])
def test_allocation_strategies(strategy: str) -> None:
    core = make(num_segments=3, allocation_strategy=strategy)
    put(core, "fill", 8 * MiB, 0.0, client="c1", config=ReplicateConfig(preferred_segment="s1"))
    h = core.put_start("c2", "k", 100, R1, 1.0)
    if strategy == "local_first":
        assert h.replicas[0].segment == "s2"
    if strategy == "free_ratio_first":
        assert h.replicas[0].segment in ("s0", "s2")
    h = core.put_start("c0", "p", 100, ReplicateConfig(preferred_segment="s1"), 1.0)
    assert h.replicas[0].segment == "s1"


def test_leases_block_remove_until_expiry_and_force() -> None:
    core = make(default_kv_lease_ttl_ms=500)
    put(core, "k", 100, 0.0)
    assert status(core.remove, "k", 0.0) == "OK" or True  # put_end grants no lease
    put(core, "k2", 100, 0.0)
    core.get_replica_list("r", "k2", 10.0)
    err = pytest.raises(StoreError, core.remove, "k2", 509.0).value
    assert err.code == ErrorCode.OBJECT_HAS_LEASE
    assert status(core.remove, "k2", 510.0) == "OK"
    put(core, "k3", 100, 0.0)
    core.exist("r", "k3", 0.0)
    core.remove("k3", 1.0, force=True)
    assert "k3" not in core.list_keys()


def test_fresh_object_is_removable_at_once() -> None:
    core = make(default_kv_lease_ttl_ms=500)
    put(core, "k", 100, 0.0)
    assert status(core.remove, "k", 0.0) == "OK"


def test_bug_17_crashed_writer_is_taken_over_and_its_space_freed() -> None:
    core = make(put_start_discard_timeout_s=30, put_start_release_timeout_s=60)
    s = 1000.0
    h1 = core.put_start("C1", "k", MiB, R1, 0.0)
    assert status(core.get_replica_list, "C2", "k", 1 * s) == "NOT_READY"
    assert status(core.remove, "k", 1 * s) == "NOT_READY"
    core.tick(1 * s)
    h2 = core.put_start("C2", "k", MiB, R1, 31 * s)
    core.put_end("C2", "k", h2.generation, 31 * s)
    assert core.get_replica_list("C2", "k", 31 * s).generation == h2.generation
    assert status(core.put_end, "C1", "k", h1.generation, 32 * s) == "STALE_HANDLE"
    assert core.get_replica_list("C2", "k", 32 * s).generation == h2.generation
    assert core.pool.used_bytes() == 2 * MiB  # C1's range still held until release
    for t in (10, 20, 40, 60, 80, 100):  # the segment's owner stays alive
        core.heartbeat("c0", t * s)
    core.tick(100 * s)
    assert core.pool.used_bytes() == MiB


def test_bug_17_abandoned_write_is_reclaimed_without_a_taker() -> None:
    core = make(put_start_discard_timeout_s=30, put_start_release_timeout_s=60,
                client_ttl_s=1000)
    core.put_start("C1", "k", MiB, R1, 0.0)
    core.tick(59_999.0)
    assert core.pool.used_bytes() == MiB
    core.tick(60_000.0)
    assert core.pool.used_bytes() == 0
    assert status(core.get_replica_list, "C2", "k", 60_000.0) == "NOT_FOUND"


def test_bug_18_stale_put_end_and_revoke_are_rejected() -> None:
    core = make(put_start_discard_timeout_s=30, put_start_release_timeout_s=60)
    h1 = core.put_start("C", "k", 4096, R1, 0.0)
    h2 = core.put_start("C", "k", 4096, R1, 30_000.0)  # takeover after the discard timeout
    assert h2.generation != h1.generation
    assert h2.replicas[0].addr != h1.replicas[0].addr  # H1's range is not reused yet
    assert status(core.put_end, "C", "k", h1.generation, 30_001.0) == "STALE_HANDLE"
    assert status(core.get_replica_list, "C", "k", 30_001.0) == "NOT_READY"
    assert status(core.put_revoke, "C", "k", h1.generation, 30_002.0) == "STALE_HANDLE"
    core.put_end("C", "k", h2.generation, 30_003.0)
    rl = core.get_replica_list("C", "k", 30_004.0)
    assert rl.generation == h2.generation and rl.replicas[0].addr == h2.replicas[0].addr


def test_bug_19_one_writer_wins_a_key() -> None:
    core = make(seg_bytes=64 * MiB)
    for i in range(1000):
        key = f"k{i}"
        results = []
        handles = []
        for w in range(8):
            try:
                handles.append(core.put_start(f"w{w}", key, 4 * MiB // 1024, R1, float(i)))
                results.append("OK")
            except StoreError as e:
                results.append(e.status)
        assert results.count("OK") == 1 and results.count("ALREADY_EXISTS") == 7
        core.put_end(handles[0].replicas and f"w{results.index('OK')}", key,
                     handles[0].generation, float(i))
        assert core.exist("r", key, float(i))
        assert core.get_replica_list("r", key, float(i)).size_bytes == 4 * MiB // 1024
        assert status(core.put_start, "w1", key, 10, R1, float(i)) == "ALREADY_EXISTS"
    assert core.pool.used_bytes() == 1000 * 4096


def test_bug_21_leases_cover_the_whole_matched_prefix() -> None:
    """Store form of the radix-lock case: a reader leases every key of the matched
    prefix chain (A, B); evicting everything frees only X and Y; releasing its leases
    lets A and B go; counts return to 0."""
    core = make(seg_bytes=8 * 4096)
    for i, key in enumerate(["A", "B", "X", "Y"]):
        put(core, key, 4096, float(i))
    for key in ["A", "B"]:  # lock(h): the matched node and all its ancestors
        core.get_replica_list("req", key, 10.0)  # a read leases (exist does not, BUG-16)
    evicted = core.evict(1 << 40, 11.0)
    assert sorted(evicted) == ["X", "Y"]
    assert sorted(core.list_keys()) == ["A", "B"]
    assert core.lease_count("B", 11.0) == 1 and core.lease_count("A", 11.0) == 1
    assert core.release_leases("req", ["A", "B"]) == 2  # unlock(h)
    assert sorted(core.evict(1 << 40, 12.0)) == ["A", "B"]
    assert core.lease_count("A", 12.0) == 0 and core.lease_count("B", 12.0) == 0
    assert core.pool.used_bytes() == 0


def test_eviction_at_watermark_skips_leased_and_pinned() -> None:
    # 100 objects of 64 KiB fill a 6.4 MiB segment; watermark 0.9, ratio 0.05
    obj = 64 * 1024
    core = make(seg_bytes=100 * obj, default_kv_lease_ttl_ms=1e9)
    hard = ReplicateConfig(hard_pin=True)
    soft = ReplicateConfig(soft_pin=True)
    for i in range(90):
        cfg = hard if i == 0 else soft if i == 1 else R1
        put(core, f"k{i:02d}", obj, float(i), config=cfg)
    core.get_replica_list("reader", "k02", 100.0)  # leased
    core.tick(100.0)
    assert core.pool.used_bytes() == 90 * obj  # exactly at the watermark: no eviction
    put(core, "k90", obj, 101.0)
    core.tick(102.0)
    # over by 1 object; ratio 5% = 5 objects; oldest unpinned, unleased: k03..k07
    gone = sorted(set(f"k{i:02d}" for i in range(91)) - set(core.list_keys()))
    assert gone == ["k03", "k04", "k05", "k06", "k07"]
    # evict everything possible: soft-pinned last, hard-pinned and leased never
    victims = core.evict(1 << 40, 200.0)
    assert victims[-1] == "k01"
    assert sorted(core.list_keys()) == ["k00", "k02"]


def test_soft_pin_expiry() -> None:
    core = make(seg_bytes=4 * 4096, default_kv_soft_pin_ttl_ms=1000)
    put(core, "pinned", 4096, 0.0, config=ReplicateConfig(soft_pin=True))
    put(core, "plain", 4096, 5.0)
    core.get_replica_list("r", "pinned", 900.0)  # reads do not extend the pin
    core.release_leases("r", ["pinned"])
    # before the deadline the pinned object goes after the unpinned (older access first)
    assert core.evict(4096, 999.0) == ["plain"]
    put(core, "plain", 4096, 999.0)
    # after the deadline (1000 ms from put_end), it is an ordinary LRU candidate
    assert core.evict(4096, 1000.0) == ["pinned"]


def test_no_space_without_overwriting_live_data() -> None:
    core = make(seg_bytes=4 * 4096, default_kv_lease_ttl_ms=1e9)
    for i in range(4):
        put(core, f"k{i}", 4096, float(i), config=ReplicateConfig(hard_pin=(i % 2 == 0)))
        core.exist("r", f"k{i}", float(i))
    before = {k: core.get_replica_list("r", k, 10.0).replicas for k in core.list_keys()}
    err = pytest.raises(StoreError, core.put_start, "c0", "new", 4096, R1, 10.0).value
    assert err.status == "NO_SPACE"
    after = {k: core.get_replica_list("r", k, 11.0).replicas for k in core.list_keys()}
    assert before == after and "new" not in core.objects


def test_full_pool_evicts_unleased_for_a_new_put() -> None:
    core = make(seg_bytes=4 * 4096)
    for i in range(4):
        put(core, f"k{i}", 4096, float(i))
    h = core.put_start("c0", "new", 4096, R1, 10.0)
    assert h.replicas and "k0" not in core.objects  # the least recently used went


def test_bug_33_replicas_survive_their_writer() -> None:
    core = make(num_segments=3, client_ttl_s=10)
    put(core, "k1", 1000, 0.0, client="c0", config=ReplicateConfig(preferred_segment="s0"))
    h2 = put(core, "k2", 1000, 0.0, client="c0",
             config=ReplicateConfig(replica_num=2, preferred_segment="s0"))
    assert len({r.segment for r in h2.replicas}) == 2
    assert len({r.host for r in h2.replicas}) == 2
    for t in (5000.0, 10_000.0):
        core.heartbeat("c1", t)
        core.heartbeat("c2", t)
        core.tick(t)
    assert core.exist("c1", "k1", 10_000.0)  # before the TTL the master still lists it
    core.heartbeat("c1", 10_001.0)
    core.heartbeat("c2", 10_001.0)
    core.tick(10_001.0)
    assert "s0" not in core.pool.segments
    assert status(core.get_replica_list, "c1", "k1", 10_002.0) == "NOT_FOUND"
    rl = core.get_replica_list("c1", "k2", 10_002.0)
    assert [r.segment for r in rl.replicas] != [] and "s0" not in {r.segment for r in rl.replicas}


@pytest.mark.parametrize("key", ["", "x" * 4097, 7, None])
def test_bad_keys(key) -> None:
    core = make()
    err = pytest.raises(StoreError, core.put_start, "c0", key, 10, R1, 0.0).value
    assert err.code == ErrorCode.INVALID_KEY and err.status == "INVALID_ARGUMENT"
    assert len(core.objects) == 0


@pytest.mark.parametrize("size", [0, -1, 1.5, True])
def test_bad_sizes(size) -> None:
    core = make()
    err = pytest.raises(StoreError, core.put_start, "c0", "k", size, R1, 0.0).value
    assert err.code == ErrorCode.INVALID_PARAMS
    assert core.pool.used_bytes() == 0


def test_value_larger_than_any_segment() -> None:
    core = make(num_segments=2, seg_bytes=MiB)
    put(core, "live", 100, 0.0)
    err = pytest.raises(StoreError, core.put_start, "c0", "big", MiB + 1, R1, 1.0).value
    assert err.code == ErrorCode.INVALID_PARAMS and "larger than every" in err.message
    assert core.list_keys() == ["live"]


@pytest.mark.parametrize("kw", [dict(replica_num=0), dict(replica_num=-1),
                                dict(replica_num=1.5), dict(soft_pin_ttl_ms=10)])
def test_bad_replicate_config(kw) -> None:
    with pytest.raises(ValueError):
        ReplicateConfig(**kw)


def test_spill_and_load_orders() -> None:
    core = MasterCore(MasterConfig())
    core.mount_segment("c0", "s0", "h", 4096, 2 * 4096, 0.0, ssd_capacity_bytes=MiB)
    put(core, "a", 4096, 0.0)
    put(core, "b", 4096, 1.0)
    # full: "a" (least recently used) is ordered to spill; its DRAM is freed only when
    # the spill is done, so this put fails at once (the service retries after the spill)
    assert status(core.put_start, "c0", "c", 4096, R1, 2.0) == "NO_SPACE"
    eff = core.drain_effects()
    assert [(s.key, s.addr) for s in eff.spills] == [("a", 4096)]
    assert core.spill_done("a", eff.spills[0].generation, "s0", ok=True)
    rl = core.get_replica_list("r", "a", 3.0)
    assert [r.tier for r in rl.replicas] == ["ssd"]
    assert "a" in core.list_keys()
    h = core.put_start("c0", "c", 4096, R1, 3.0)
    assert h.replicas[0].addr == 4096  # a's old DRAM range
    core.put_end("c0", "c", h.generation, 3.0)
    core.release_leases("r", ["a"])
    # full again: loading "a" back orders "b" to spill; room comes when that is done
    assert status(core.promote_start, "a", 4.0) == "NO_SPACE"
    (sp,) = core.drain_effects().spills
    assert sp.key == "b" and core.spill_done("b", sp.generation, "s0", ok=True)
    order = core.promote_start("a", 5.0)
    assert (order.key, order.addr, order.length) == ("a", 8192, 4096)
    assert status(core.get_replica_list, "r", "a", 5.0) == "OK"
    core.promote_done(order, ok=True, now_ms=6.0)
    tiers = sorted(r.tier for r in core.get_replica_list("r", "a", 6.0).replicas)
    assert tiers == ["dram", "ssd"]
    assert sorted(core.list_keys()) == ["a", "b", "c"]
    assert core.stats(6.0)["ssd_used_bytes"] == 2 * 4096


def test_spill_never_frees_dram_under_a_reader() -> None:
    core = MasterCore(MasterConfig(default_kv_lease_ttl_ms=1000))
    core.mount_segment("c0", "s0", "h", 4096, 2 * 4096, 0.0, ssd_capacity_bytes=MiB)
    put(core, "a", 4096, 0.0)
    put(core, "b", 4096, 1.0)
    assert core.evict(4096, 2.0) == ["a"]
    (sp,) = core.drain_effects().spills
    rl = core.get_replica_list("reader", "a", 3.0)  # a read starts while "a" is copied out
    assert core.spill_done("a", sp.generation, "s0", ok=True, now_ms=4.0)
    assert core.pool.used_bytes() == 2 * 4096  # the reader's range is still allocated
    assert sorted(r.tier for r in core.get_replica_list("x", "a", 5.0).replicas) == \
        ["dram", "ssd"]
    assert rl.replicas[0].addr == 4096
    # once unleased, a later eviction drops only the DRAM copy (the SSD copy exists)
    core.get_replica_list("x", "b", 5.5)  # "b" is now more recently used than "a"
    core.release_leases("reader", ["a"])
    core.release_leases("x", ["a", "b"])
    assert core.evict(4096, 6.0) == ["a"]
    assert core.drain_effects().spills == []
    assert core.pool.used_bytes() == 4096
    assert [r.tier for r in core.get_replica_list("x", "a", 7.0).replicas] == ["ssd"]


def test_bug_34_exist_excludes_failed_segments_without_lease() -> None:
    """A key whose every replica is on a segment the caller knows failed is absent to
    that caller; one live replica keeps it present; no lease is granted for an absent key."""
    core = make(num_segments=3, default_kv_lease_ttl_ms=1000.0)
    put(core, "one", 4096, 0.0, config=ReplicateConfig(preferred_segment="s1"))
    put(core, "two", 4096, 0.0, config=ReplicateConfig(replica_num=2,
                                                          preferred_segment="s1"))
    segs = {r.segment for r in core.get_replica_list("c0", "two", 1.0).replicas}
    assert len(segs) == 2 and "s1" in segs
    core.release_leases("c0", ["two"])
    assert core.exist("c2", "one", 2.0, frozenset({"s1"})) is False
    assert core.lease_count("one", 2.0) == 0
    assert core.exist("c2", "one", 2.0, frozenset({"s0", "s2"})) is True
    assert core.lease_count("one", 2.0) == 0  # exist never leases (BUG-16)
    assert core.exist("c2", "two", 2.0, frozenset({"s1"})) is True
    assert core.exist("c2", "two", 2.0, frozenset(segs)) is False
    assert core.exist("c2", "one", 2.0) is True  # nothing excluded: the table's answer


def test_size_of_answers_without_a_lease() -> None:
    """``get_size`` (issue 16: a metadata call, no replica list): the size of a published
    object, no lease granted (a remove right after succeeds), the writer's object not yet,
    a missing key not found, and the failed-segment rule of ``exist``."""
    core = make(num_segments=2, default_kv_lease_ttl_ms=1000.0)
    put(core, "k", 1234, 0.0, config=ReplicateConfig(preferred_segment="s1"))
    assert core.size_of("k", 1.0) == 1234
    assert core.lease_count("k", 1.0) == 0
    assert status(core.size_of, "nope", 1.0) == "NOT_FOUND"
    assert status(core.size_of, "k", 1.0, frozenset({"s1"})) == "NOT_FOUND"
    assert core.size_of("k", 1.0, frozenset({"s0"})) == 1234
    core.put_start("c0", "w", 10, R1, 2.0)
    assert status(core.size_of, "w", 2.0) == "NOT_READY"
    core.remove("k", 2.0)  # no lease held: removable at once
    assert status(core.size_of, "k", 3.0) == "NOT_FOUND"
