"""The master's periodic work costs what is in flight, not what is stored (issue 16: the P/D
cluster's master burnt CPU scanning every object 10 times a second): ``tick`` finds
abandoned writes through ``ObjectTable.writing`` without iterating the table, and
``stats`` (the gauges, every second) reads each object's namespace from the table's cache."""

from __future__ import annotations

import pytest

from pymooncake.store.config import MasterConfig, ReplicateConfig
from pymooncake.store.master.core import MasterCore
from pymooncake.store.master.objects import ObjectTable

MiB = 1 << 20
R1 = ReplicateConfig()


def make(**cfg) -> MasterCore:
    core = MasterCore(MasterConfig(**cfg))
    core.mount_segment("c0", "s0", "host0", 1 << 32, 64 * MiB, 0.0)
    return core


def put(core: MasterCore, key: str, size: int, now: float, client: str = "c0",
        config: ReplicateConfig = R1) -> None:
    h = core.put_start(client, key, size, config, now)
    core.put_end(client, key, h.generation, now)


@pytest.fixture
def no_full_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Iterating the whole object table fails the test."""
    def refuse(self: ObjectTable):
        raise AssertionError("the whole object table was iterated")
    monkeypatch.setattr(ObjectTable, "__iter__", refuse)


def test_writing_lists_exactly_the_writes_in_flight() -> None:
    core = make(put_start_discard_timeout_s=30, put_start_release_timeout_s=60)
    for i in range(100):
        put(core, f"kv/ns/{i}", 4096, 0.0)
    a = core.put_start("c0", "a", 4096, R1, 1.0)
    b = core.put_start("c0", "b", 4096, R1, 2.0)
    c = core.put_start("c0", "c", 4096, R1, 3.0)
    assert [o.key for o in core.objects.writing()] == ["a", "b", "c"]
    core.put_end("c0", "a", a.generation, 4.0)        # published
    core.put_revoke("c0", "b", b.generation, 4.0)     # revoked
    assert [o.key for o in core.objects.writing()] == ["c"]
    # a takeover after the discard timeout: the new write is the one in flight
    c2 = core.put_start("c1", "c", 4096, R1, 40_000.0)
    (w,) = core.objects.writing()
    assert w.key == "c" and w.generation == c2.generation != c.generation
    core.put_end("c1", "c", c2.generation, 40_001.0)
    assert core.objects.writing() == []
    assert len(core.objects) == 102


def test_tick_reclaims_an_abandoned_write_without_a_full_scan(no_full_scan: None) -> None:
    core = make(put_start_discard_timeout_s=30, put_start_release_timeout_s=60,
                client_ttl_s=1000)
    for i in range(2000):
        put(core, f"kv/ns/{i}", 4096, 0.0)
    used = core.pool.used_bytes()
    core.put_start("crashed", "k", MiB, R1, 0.0)
    core.put_start("c0", "fresh", MiB, R1, 50_000.0)
    core.heartbeat("c0", 50_000.0)
    core.tick(59_999.0)
    assert core.pool.used_bytes() == used + 2 * MiB
    core.heartbeat("c0", 60_000.0)
    core.tick(60_000.0)                   # "k" was started 60 s ago: released
    assert core.pool.used_bytes() == used + MiB
    assert "k" not in core.objects and "fresh" in core.objects
    assert [o.key for o in core.objects.writing()] == ["fresh"]
    assert len(core.objects) == 2001


def test_a_dropped_clients_writes_are_discarded_without_a_full_scan(
        no_full_scan: None) -> None:
    core = make(client_ttl_s=10, put_start_release_timeout_s=600)
    for i in range(500):
        put(core, f"kv/ns/{i}", 4096, 0.0, client="c0")
    core.put_start("w", "half", 4096, R1, 0.0)      # client w then goes silent
    put(core, "done-by-w", 4096, 0.0, client="w")
    core.heartbeat("c0", 11_000.0)
    core.tick(11_000.0)
    assert "w" in core.effects.dropped_clients and "c0" not in core.effects.dropped_clients
    assert "half" not in core.objects                  # its write was discarded
    assert "done-by-w" in core.objects                 # a published object stays
    assert core.objects.writing() == []


def test_stats_bytes_per_namespace_and_pins() -> None:
    core = make(default_kv_soft_pin_ttl_ms=1000)
    for i in range(10):
        put(core, f"kv/ns/{i}", 4096, 0.0)
    for i in range(3):
        put(core, f"tenant:{i}", 100, 0.0, config=ReplicateConfig(soft_pin=True))
    put(core, "plain", 64, 0.0, config=ReplicateConfig(hard_pin=True))
    core.put_start("c0", "kv/ns/writing", 4096, R1, 0.0)   # not published: not counted
    st = core.stats(500.0)
    assert st["num_objects"] == 15
    assert st["bytes_per_namespace"] == {"kv": 10 * 4096, "tenant": 300, "": 64}
    assert st["num_soft_pinned"] == 3 and st["num_hard_pinned"] == 1
    assert core.stats(1000.0)["num_soft_pinned"] == 0    # the soft pins lapsed
    core.remove("kv/ns/3", 2000.0)
    assert core.stats(2000.0)["bytes_per_namespace"]["kv"] == 9 * 4096
    assert "kv/ns/3" not in core.objects.namespaces
    assert len(core.objects.namespaces) == len(core.objects) == 14
