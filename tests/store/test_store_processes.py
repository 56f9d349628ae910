"""The store with real processes on 127.0.0.1: a master (hosting the HTTP metadata
server), store servers contributing DRAM, and clients in this process; every byte moves
through the Transfer Engine."""

from __future__ import annotations

import os
import time

import pytest

from pymooncake.store.config import ReplicateConfig
from pymooncake.store.errors import ErrorCode, StoreError

from .procs import MiB

pytestmark = pytest.mark.integration


def pattern(seed: int, n: int) -> bytes:
    return (bytes([seed % 251]) + os.urandom(15)) * (n // 16) + bytes(n % 16)


def test_put_get_two_phase_and_distinct_replicas(cluster_factory) -> None:
    cl = cluster_factory()
    s1 = cl.store_server(8 * MiB)
    s2 = cl.store_server(8 * MiB)
    writer = cl.client()
    reader = cl.client()
    v = pattern(1, 3 * MiB + 5)
    writer.put("k", v, ReplicateConfig(replica_num=2))
    assert reader.get("k") == v
    assert reader.exist("k")
    st = reader.stats()
    assert st["dram_used_bytes"] == 2 * ((len(v) + 63) // 64 * 64)
    segs = {s1.info["segment"], s2.info["segment"]}
    assert {r.segment for r in reader.replica_list("k").replicas} == segs
    # two-phase: a key whose put is not yet ended is invisible to readers
    h = writer.put_start("half", 100)
    assert not reader.exist("half")
    with pytest.raises(StoreError) as ei:
        reader.get("half")
    assert ei.value.status == "NOT_READY"
    writer.put_end("half", h.generation)
    assert reader.exist("half")


def wait_until(pred, timeout_s: float = 10.0, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval_s)
    return pred()


def status_of(fn, *args, **kw) -> str:
    try:
        fn(*args, **kw)
    except StoreError as e:
        return e.status
    return "OK"


class CountingPath:
    """Wraps a client's data path to count the moves sent to each segment."""

    def __init__(self, client) -> None:
        self.inner = client._dp.run
        self.by_segment: dict[str, int] = {}
        client._dp.run = self

    def __call__(self, moves):
        for m in moves:
            self.by_segment[m.segment] = self.by_segment.get(m.segment, 0) + 1
        return self.inner(moves)


def test_bug_33_34_replica_fallback_and_dead_segments_unmounted(cluster_factory) -> None:
    cl = cluster_factory("--client-ttl", "1.5")
    servers = [cl.store_server(4 * MiB) for _ in range(3)]
    s1 = servers[0].info["segment"]
    writer = cl.client()
    v1, v2 = pattern(1, MiB), pattern(2, MiB)
    writer.put("k1", v1, ReplicateConfig(preferred_segment=s1))
    writer.put("k2", v2, ReplicateConfig(replica_num=2, preferred_segment=s1))
    placed = [r.segment for r in writer.replica_list("k2").replicas]
    assert len(set(placed)) == 2 and s1 in placed
    assert [r.segment for r in writer.replica_list("k1").replicas] == [s1]
    reader = cl.client()
    counter = CountingPath(reader)
    servers[0].kill()  # no unmount, no goodbye
    # before the TTL: k2 falls back to its live replica; k1 is a prompt miss
    t0 = time.monotonic()
    for _ in range(3):
        assert reader.get("k2") == v2
    results = [status_of(reader.get, "k1") for _ in range(10)]
    assert results == ["NOT_FOUND"] * 10
    assert time.monotonic() - t0 < 8.0
    # BUG-34: only the first request paid for the dead segment; the rest skipped it
    assert counter.by_segment.get(s1, 0) <= 2
    # after the TTL the dead client's segment is unmounted and k1 is gone
    assert wait_until(lambda: not reader.exist("k1"), 10.0)
    assert reader.stats()["num_segments"] == 2
    assert reader.get("k2") == v2
    assert s1 not in {r.segment for r in reader.replica_list("k2").replicas}


def test_eviction_at_watermark_skips_leased_and_pinned(cluster_factory) -> None:
    cl = cluster_factory("--default-kv-lease-ttl", "60000")
    cl.store_server(MiB)
    w = cl.client()
    r = cl.client()
    obj = 64 * 1024
    vals = {f"o{i:02d}": pattern(i, obj) for i in range(15)}
    cfgs = {"o00": ReplicateConfig(hard_pin=True), "o01": ReplicateConfig(soft_pin=True)}
    for i, (k, v) in enumerate(vals.items()):
        if i == 14:
            # 14 × 64 KiB = 0.875 of 1 MiB: under the 0.90 watermark, nothing evicted
            time.sleep(0.3)
            assert len(w.list_keys()) == 14
            assert r.exist("o02")  # leased by the reader
        w.put(k, v, cfgs.get(k))
    # 15 objects = 0.9375 > 0.90: a pass frees max(5% of 1 MiB, excess) → one object,
    # the least recently used one that is not pinned, leased or unpublished: o03
    assert wait_until(lambda: len(w.list_keys()) == 14, 5.0)
    assert sorted(set(vals) - set(w.list_keys())) == ["o03"]
    for k in w.list_keys():
        assert r.get(k) == vals[k]


def test_no_space_error_without_data_loss(cluster_factory) -> None:
    cl = cluster_factory("--eviction-high-watermark-ratio", "1.0")
    cl.store_server(MiB)
    w = cl.client()
    obj = 256 * 1024
    vals = {f"h{i}": pattern(i, obj) for i in range(4)}
    for k, v in vals.items():
        w.put(k, v, ReplicateConfig(hard_pin=True))
    with pytest.raises(StoreError) as ei:
        w.put("more", pattern(9, obj))
    assert ei.value.code == ErrorCode.NO_AVAILABLE_HANDLE and ei.value.status == "NO_SPACE"
    assert sorted(w.list_keys()) == sorted(vals)
    for k, v in vals.items():
        assert w.get(k) == v
    assert not w.exist("more")


def test_soft_pin_expiry(cluster_factory) -> None:
    cl = cluster_factory("--eviction-high-watermark-ratio", "1.0",
                         "--default-kv-soft-pin-ttl", "1500", "--default-kv-lease-ttl", "100")
    cl.store_server(256 * 1024)
    w = cl.client()
    obj = 64 * 1024
    w.put("pinned", pattern(1, obj), ReplicateConfig(soft_pin=True))
    t_pin = time.monotonic()
    for k in ("a", "b", "c"):
        w.put(k, pattern(2, obj))
    w.put("d", pattern(3, obj))  # full: the oldest *unpinned* object goes
    assert sorted(w.list_keys()) == ["b", "c", "d", "pinned"]
    for k in ("pinned", "b", "c", "d"):  # pinned is now the least recently used;
        w.get(k)                         # reads do not extend its pin
    time.sleep(0.15)  # let the read leases lapse
    w.put("e", pattern(4, obj))
    assert sorted(w.list_keys()) == ["c", "d", "e", "pinned"]
    assert time.monotonic() - t_pin < 1.5, "machine too slow for this pin TTL"
    time.sleep(max(0.0, 1.6 - (time.monotonic() - t_pin)))
    w.put("f", pattern(5, obj))  # the pin lapsed: pinned is just the oldest access
    assert sorted(w.list_keys()) == ["c", "d", "e", "f"]
