"""Adding one replica to a published object, in two phases (pure; DESIGN.md §5, §7).

Hot-block replication (the Conductor, FAST'25 §4.2 / Figure 11) copies a hot KV block to
one more segment: the segment of the prefill instance that is to hold it. Unlike a put, the
object is already readable and stays readable throughout:

1. ``copy_start``: allocate the object's size on ``segment`` (evicting cold objects there
   when it is full), append a *PROCESSING* replica (readers never see it: only complete
   replicas are readable) and lease the object to the copier so that eviction skips it
   while its bytes are in flight. Returns the source replica and the new one.
2. the copier moves the bytes (``store.master.copier``: READ from the source, WRITE to the
   new replica, Transfer Engine);
3. ``copy_end(ok)``: the new replica becomes readable, or (``ok=False``) its range is
   freed; the lease is released. An object removed or a segment unmounted meanwhile
   answers ``False`` (its ranges went with it).

Every call takes ``now_ms``; errors are ``StoreError`` with Mooncake's codes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pymooncake.store.errors import ErrorCode, StoreError
from pymooncake.store.master.objects import Replica
from pymooncake.store.protocol import TIER_DRAM

if TYPE_CHECKING:
    from pymooncake.store.master.core import MasterCore

COPIER = "__replicator__"
"""Lease holder name of replica copies in flight."""
COPY_LEASE_MS = 30_000.0
"""Longest a copy keeps its object from eviction (a copier that died lets it go)."""


def replica_segments(core: MasterCore, keys: list[str]) -> list[list[str] | None]:
    """Segments holding a readable DRAM replica of each key (``None``: absent or not yet
    published). No lease is taken (a metadata query, not a read)."""
    out: list[list[str] | None] = []
    for k in keys:
        obj = core.objects.get(k) if isinstance(k, str) else None
        if obj is None or not obj.complete:
            out.append(None)
        else:
            out.append(sorted(r.segment for r in obj.replicas
                              if r.complete and r.tier == TIER_DRAM))
    return out


def copy_start(core: MasterCore, key: str, segment: str, now_ms: float
               ) -> tuple[Replica, Replica]:
    """Phase 1 (module docstring): ``(source replica, new PROCESSING replica)``.

    Raises ``OBJECT_NOT_FOUND``, ``REPLICA_IS_NOT_READY`` (unpublished, or only on SSD,
    or being spilled/loaded), ``INVALID_PARAMS`` (segment not mounted),
    ``OBJECT_ALREADY_EXISTS`` (``segment`` already holds a replica, complete or not) and
    ``NO_AVAILABLE_HANDLE`` (no room on ``segment`` even after evicting there).
    """
    obj = core._lookup(key)
    if not obj.complete or obj.spilling or obj.promoting:
        raise StoreError(ErrorCode.REPLICA_IS_NOT_READY, f"key {key!r} is not at rest")
    seg = core.pool.segments.get(segment)
    if seg is None:
        raise StoreError(ErrorCode.INVALID_PARAMS, f"segment {segment!r} is not mounted")
    if any(r.segment == segment and r.tier == TIER_DRAM for r in obj.replicas):
        raise StoreError(ErrorCode.OBJECT_ALREADY_EXISTS,
                         f"segment {segment!r} already holds {key!r}")
    src = next((r for r in obj.replicas if r.complete and r.tier == TIER_DRAM), None)
    if src is None:
        raise StoreError(ErrorCode.REPLICA_IS_NOT_READY, f"{key!r} has no DRAM replica")
    # leased first: the eviction below (making room on the segment) must not pick it
    core.leases.grant(key, COPIER, now_ms, COPY_LEASE_MS)
    off = seg.allocator.allocate(obj.size_bytes)
    if off is None and seg.allocator.capacity_bytes >= obj.size_bytes:
        core._evict_for(obj.size_bytes, now_ms, segment)
        off = seg.allocator.allocate(obj.size_bytes)
    if off is None:
        core.leases.release(key, COPIER)
        raise StoreError(ErrorCode.NO_AVAILABLE_HANDLE,
                         f"no room for {obj.size_bytes} bytes of {key!r} on {segment!r}")
    core._replica_id += 1
    new = Replica(core._replica_id, seg.name, seg.base_addr + off, obj.size_bytes,
                  TIER_DRAM, seg.host, complete=False)
    obj.replicas.append(new)
    core.objects.touch(key)
    return src, new


def copy_end(core: MasterCore, key: str, replica_id: int, ok: bool, now_ms: float) -> bool:
    """Phase 3: publish (``ok``) or drop replica ``replica_id`` of ``key``. ``False`` when
    it is gone (object removed or its segment unmounted meanwhile) or was dropped now."""
    core.leases.release(key, COPIER)
    obj = core.objects.get(key)
    rep = None if obj is None else next(
        (r for r in obj.replicas if r.replica_id == replica_id), None)
    if obj is None or rep is None:
        return False
    core.objects.touch(key)
    if ok:
        rep.complete = True
        obj.last_access_ms = max(obj.last_access_ms, now_ms)
        return True
    obj.replicas.remove(rep)
    core.pool.free(rep.segment, rep.addr)
    return False
