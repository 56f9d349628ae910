"""KvState, the pure core behind the embedded and HTTP backends (clock passed in)."""

from __future__ import annotations

import pytest

from pymooncake.metadata.base import EventKind, LeaseNotFound, WatchCompacted
from pymooncake.metadata.core import KvState


def test_revisions_and_lease_expiry_at_exact_deadline() -> None:
    kv = KvState()
    lease = kv.grant_lease(2.0, now_s=10.0)
    assert kv.put("a", b"1", now_s=10.0, lease_id=lease) == 1
    assert kv.put("b", b"2", now_s=10.5) == 2
    kv.keep_alive(lease, now_s=11.0)  # new deadline 13.0
    assert kv.get("a", now_s=12.999) is not None
    assert kv.get("a", now_s=13.0) is None  # deadline reached: expired
    assert kv.revision == 3
    assert [(e.kind, e.key, e.revision) for e in kv.events_since(0, "")] == [
        (EventKind.PUT, "a", 1), (EventKind.PUT, "b", 2), (EventKind.DELETE, "a", 3)]
    with pytest.raises(LeaseNotFound):
        kv.keep_alive(lease, now_s=13.0)


def test_compacted_history_is_reported() -> None:
    kv = KvState(history_len=2)
    for i in range(4):
        kv.put(f"k{i}", b"", now_s=0.0)
    assert [e.revision for e in kv.events_since(2, "")] == [3, 4]
    with pytest.raises(WatchCompacted):
        kv.events_since(1, "")


def test_repointing_a_key_to_another_lease() -> None:
    kv = KvState()
    l1, l2 = kv.grant_lease(1.0, 0.0), kv.grant_lease(5.0, 0.0)
    kv.put("k", b"x", 0.0, lease_id=l1)
    kv.put("k", b"y", 0.5, lease_id=l2)
    assert kv.get("k", 1.5) is not None  # l1 expired but no longer owns k
    assert kv.get("k", 5.0) is None
