"""Eviction and leases under a full store, on the master's pure core with a fake clock:
lookups grant no lease (case BUG-16), the watermark pass's target counts only objects it
can evict (case BUG-62), a load from SSD makes room in its owner's segment."""

from __future__ import annotations

from pymooncake.store.config import MasterConfig, ReplicateConfig
from pymooncake.store.master.core import MasterCore

from .test_master_core import put, status

MiB = 1 << 20
UNIT = 64 * 1024
R1 = ReplicateConfig()


def _bug16_core() -> MasterCore:
    core = MasterCore(MasterConfig(eviction_high_watermark_ratio=0.8, eviction_ratio=0.1,
                                   default_kv_lease_ttl_ms=5000))
    core.mount_segment("w", "s0", "h", 1 << 32, 100 * UNIT, 0.0)
    for i in range(95):
        put(core, f"k{i:02d}", UNIT, 0.0, client="w")
    return core


def test_bug_16_exist_polling_grants_no_lease_so_eviction_frees_room() -> None:
    core = _bug16_core()
    now = 0.0
    for _ in range(10):  # a poller checks every key every second, never reads
        now += 1000.0
        present = set(core.list_keys())
        for i in range(95):
            assert core.exist("poller", f"k{i:02d}", now) == (f"k{i:02d}" in present)
        core.tick(now)
        assert core.leases.num_leased(now) == 0
    assert core.drain_effects().stalled_passes == 0
    assert core.pool.used_bytes() <= 0.8 * 100 * UNIT  # eviction freed >= 15 units
    for i in range(10):
        put(core, f"new{i}", UNIT, now + 1, client="w")
    assert core.pool.used_bytes() <= 0.9 * 100 * UNIT
    assert all(f"new{i}" in core.list_keys() for i in range(10))


def test_bug_16_really_leased_store_fails_fast_and_reports_the_stall() -> None:
    core = _bug16_core()
    now = 0.0
    for _ in range(10):  # now a reader really reads (leases) every key every second
        now += 1000.0
        for i in range(95):
            core.get_replica_list("reader", f"k{i:02d}", now)
        core.tick(now)
    assert core.drain_effects().stalled_passes == 10  # a metric, not silence
    for i in range(5):  # the free 5 units fill; the reader reads these too
        put(core, f"new{i}", UNIT, now, client="w")
        core.get_replica_list("reader", f"new{i}", now)
    assert status(core.put_start, "w", "more", UNIT, R1, now) == "NO_SPACE"  # at once
    now += 5000.0  # the leases lapse
    core.tick(now)
    put(core, "more", UNIT, now, client="w")


def test_bug_62_watermark_target_counts_only_evictable_memory_objects() -> None:
    core = MasterCore(MasterConfig(eviction_high_watermark_ratio=0.9, eviction_ratio=0.1))
    core.mount_segment("w", "s0", "h", 1 << 32, 64 * MiB, 0.0, ssd_capacity_bytes=1 << 30)
    now = 0.0
    for i in range(1000):  # 1000 objects that live only on SSD
        now += 1.0
        put(core, f"ssd{i:04d}", MiB, now, client="w")
        core._evict(f"ssd{i:04d}", "test")
        (order,) = core.drain_effects().spills
        assert core.spill_done(order.key, order.generation, "s0", ok=True, now_ms=now)
    assert core.pool.used_bytes() == 0
    for i in range(60):
        now += 1.0
        put(core, f"mem{i:02d}", MiB, now, client="w")
    assert core.pool.used_bytes() == 60 * MiB
    victims = core.watermark_pass(now + 1)
    assert len(victims) == 6  # ceil(0.1 × 60), never from 1060
    assert victims == [f"mem{i:02d}" for i in range(6)]  # least recently used first
    for order in core.drain_effects().spills:
        core.spill_done(order.key, order.generation, "s0", ok=True, now_ms=now + 2)
    assert core.pool.used_bytes() == 54 * MiB


def test_load_from_ssd_makes_room_in_its_owners_segment() -> None:
    core = MasterCore(MasterConfig(eviction_high_watermark_ratio=1.0))
    core.mount_segment("a", "s0", "h0", 1 << 32, 4 * MiB, 0.0, ssd_capacity_bytes=1 << 30)
    core.mount_segment("b", "s1", "h1", 2 << 32, 64 * MiB, 0.0)  # plenty of room elsewhere
    pref = ReplicateConfig(preferred_segment="s0")
    put(core, "cold", MiB, 0.0, client="a", config=pref)
    core._evict("cold", "test")
    (order,) = core.drain_effects().spills
    core.spill_done(order.key, order.generation, "s0", ok=True, now_ms=1.0)
    for i in range(4):
        put(core, f"hot{i}", MiB, 2.0 + i, client="a", config=pref)
    assert core.pool.segments["s0"].allocator.free_bytes == 0
    # the load must land in s0 (the SSD owner's DRAM): room is made there, not in s1
    assert status(core.promote_start, "cold", 10.0) == "NO_SPACE"  # a spill in flight
    spills = core.drain_effects().spills
    assert [(s.key, s.segment) for s in spills] == [("hot0", "s0")]
    core.spill_done("hot0", spills[0].generation, "s0", ok=True, now_ms=11.0)
    load = core.promote_start("cold", 12.0)
    assert load is not None and load.segment == "s0"
