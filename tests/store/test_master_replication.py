"""Adding a replica to a published object (``store.master.replication``), pure core with
a fake clock: the new replica is invisible until ``copy_end``, a failed copy frees its
range, the copy's lease keeps the object from eviction, a full target segment evicts a
cold object there, and the refusals carry Mooncake's codes."""

from __future__ import annotations

import pytest

from pymooncake.store.config import ReplicateConfig
from pymooncake.store.errors import ErrorCode, StoreError
from pymooncake.store.master.core import MasterCore
from pymooncake.store.master.replication import (
    COPIER,
    copy_end,
    copy_start,
    replica_segments,
)
from tests.store.test_master_core import make, put

KiB = 1 << 10


def _segs(core: MasterCore, key: str) -> list[str]:
    return [r.segment for r in core.get_replica_list("c0", key, 0.0).replicas]


def _code(fn, *args) -> ErrorCode:
    with pytest.raises(StoreError) as e:
        fn(*args)
    return e.value.code


def test_copy_is_invisible_until_it_ends() -> None:
    core = make(2)
    put(core, "k", 4 * KiB, 0.0, config=ReplicateConfig(preferred_segment="s0"))
    src, new = copy_start(core, "k", "s1", 1.0)
    assert (src.segment, new.segment, new.length, new.complete) == ("s0", "s1", 4 * KiB, False)
    assert _segs(core, "k") == ["s0"]                       # readers: the old replica only
    assert replica_segments(core, ["k", "nope"]) == [["s0"], None]
    assert core.pool.segments["s1"].used_bytes == 4 * KiB    # the range is allocated
    assert copy_end(core, "k", new.replica_id, True, 2.0)
    assert sorted(_segs(core, "k")) == ["s0", "s1"]
    assert replica_segments(core, ["k"]) == [["s0", "s1"]]
    # a second copy to a segment that holds it is refused
    assert _code(copy_start, core, "k", "s1", 3.0) == ErrorCode.OBJECT_ALREADY_EXISTS


def test_failed_copy_frees_its_range() -> None:
    core = make(2)
    put(core, "k", 4 * KiB, 0.0, config=ReplicateConfig(preferred_segment="s0"))
    _, new = copy_start(core, "k", "s1", 1.0)
    assert not copy_end(core, "k", new.replica_id, False, 2.0)
    assert core.pool.segments["s1"].used_bytes == 0
    assert _segs(core, "k") == ["s0"]
    assert not core.leases.release("k", COPIER)              # the copy's lease is gone


def test_refusals() -> None:
    core = make(2)
    assert _code(copy_start, core, "absent", "s1", 0.0) == ErrorCode.OBJECT_NOT_FOUND
    core.put_start("c0", "w", 1 * KiB, ReplicateConfig(), 0.0)       # not yet published
    assert _code(copy_start, core, "w", "s1", 0.0) == ErrorCode.REPLICA_IS_NOT_READY
    put(core, "k", 1 * KiB, 0.0, config=ReplicateConfig(preferred_segment="s0"))
    assert _code(copy_start, core, "k", "s9", 0.0) == ErrorCode.INVALID_PARAMS


def test_object_removed_during_copy() -> None:
    core = make(2)
    put(core, "k", 4 * KiB, 0.0, config=ReplicateConfig(preferred_segment="s0"))
    _, new = copy_start(core, "k", "s1", 1.0)
    core.remove("k", 1.5, force=True)                       # frees every range, ours too
    assert not copy_end(core, "k", new.replica_id, True, 2.0)
    assert core.pool.segments["s1"].used_bytes == 0


def test_copy_evicts_cold_objects_on_a_full_target_but_never_its_own() -> None:
    core = make(2, seg_bytes=8 * KiB, default_kv_lease_ttl_ms=0.0)
    put(core, "cold", 8 * KiB, 0.0, config=ReplicateConfig(preferred_segment="s1"))
    put(core, "hot", 8 * KiB, 1.0, config=ReplicateConfig(preferred_segment="s0"))
    # s1 is full of "cold": it is evicted to make room for the copy of "hot"
    _, new = copy_start(core, "hot", "s1", 2.0)
    assert core.objects.get("cold") is None
    # while the copy runs, a put needing room on s0 must not evict "hot" (leased)
    assert core._candidates(3.0) == []
    assert copy_end(core, "hot", new.replica_id, True, 4.0)
    assert sorted(_segs(core, "hot")) == ["s0", "s1"]
    assert [c.key for c in core._candidates(5.0)] == ["hot"]   # lease released
