"""Storage holders rejoin, and replicas found bad are dropped (issue 17), pure.

A storage process with an SSD tier has a *holder* id: a random id its SSD directory keeps
in ``.holder`` (``SsdTier.holder()``). Only one live process owns a directory (its lock,
case BUG-29), so a mount carrying the holder of a segment that is still mounted under
another name comes from that holder's next life: ``takeover`` drops the old segment at
once instead of after ``client_ttl`` (its DRAM replicas are lost with the process).

When a holder's segment is dropped (takeover, silence past ``client_ttl``, unmount), an
object left without any replica that had an SSD copy there is remembered in
``core.lost_ssd[holder]`` as ``(size, checksum)``. The restarted holder scans its
directory, verifies every file and sends ``(key, size, per-chunk checksum)`` of the
intact ones (``register_ssd``); each becomes an SSD replica in its new segment when

* the master holds the key's published object with the same size and checksum (it
  gains the replica; one it already has on that segment is kept, never counted twice), or
* the key's object was lost with this holder (``lost_ssd``) with that size and checksum
  and nothing has removed the key since: the object is re-created from the file.

Anything else — a key now holding other bytes, being written, removed meanwhile, or never
known (a master restarted without HA knows nothing) — is refused with a reason, and the
holder deletes the file. The final batch forgets the holder's unclaimed ``lost_ssd``.
``lost_ssd`` is not journaled: after an HA fail-over only objects the new leader still
knows are re-registered.

``drop_bad_replicas``: a client read a replica whose bytes failed the object's checksum
(and confirmed it by a second read); the replica is dropped so later reads go elsewhere.
Its DRAM range is freed one lease TTL later (a reader holding a lease may still copy it;
what it copies fails the check anyway). The last readable replica is never dropped by a
report: reads of it keep failing ``CHECKSUM_MISMATCH`` naming the key (and ranged reads
of its intact chunks still succeed) until the key is removed — a report is one client's
word, and it must not be able to make a key vanish.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pymooncake.store.checksum import describe, well_formed
from pymooncake.store.errors import ErrorCode, StoreError
from pymooncake.store.master.objects import ObjectMeta, ObjectState, Replica
from pymooncake.store.protocol import TIER_DRAM, TIER_SSD

if TYPE_CHECKING:
    from pymooncake.store.master.core import MasterCore

REGISTERED = ""
"""``register_ssd``'s answer for an entry that is now an SSD replica."""


def takeover(core: MasterCore, holder: str, name: str) -> list[str]:
    """Drop the segments of ``holder`` mounted under names other than ``name`` (its dead
    previous lives); the dropped names."""
    old = [s.name for s in core.pool.segments.values()
           if s.holder == holder and s.name != name]
    for seg in old:
        core._drop_segment(seg)
    return old


def remember_lost(core: MasterCore, segment: str, obj: ObjectMeta) -> None:
    """``obj`` was just dropped with ``segment``, where it had an SSD copy."""
    seg = core.pool.segments.get(segment)
    if seg is not None and seg.holder and obj.complete and obj.checksum is not None:
        core.lost_ssd.setdefault(seg.holder, {})[obj.key] = (obj.size_bytes, obj.checksum)


def forget_lost(core: MasterCore, key: str) -> None:
    for lost in core.lost_ssd.values():
        lost.pop(key, None)


def _check_entry(entry: tuple[str, int, bytes]) -> tuple[str, int, bytes]:
    key, size, checksum = entry
    if not isinstance(key, str) or not key:
        raise StoreError(ErrorCode.INVALID_KEY, f"key {key!r} is not a non-empty str")
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise StoreError(ErrorCode.INVALID_PARAMS, f"{key!r}: size {size!r} must be > 0")
    if not well_formed(checksum, size):
        raise StoreError(ErrorCode.INVALID_PARAMS, f"{key!r}: checksum must be {describe(size)}")
    return key, size, checksum


def register_ssd(core: MasterCore, client_id: str, segment: str, holder: str,
                 entries: list[tuple[str, int, bytes]], final: bool, now_ms: float
                 ) -> list[str]:
    """Register a rejoining holder's intact SSD files (see module docstring): one answer
    per entry, ``REGISTERED`` or why it was refused. ``SEGMENT_NOT_FOUND`` /
    ``ILLEGAL_CLIENT`` when ``segment`` is not this client's mounted segment of ``holder``."""
    seg = core.pool.segments.get(segment)
    if seg is None:
        raise StoreError(ErrorCode.SEGMENT_NOT_FOUND, f"segment {segment!r} is not mounted")
    if seg.client_id != client_id or not holder or seg.holder != holder:
        raise StoreError(ErrorCode.ILLEGAL_CLIENT,
                         f"segment {segment!r} is not client {client_id!r}'s segment of "
                         f"holder {holder!r}")
    core._touch(client_id, now_ms)
    lost = core.lost_ssd.get(holder, {})
    out: list[str] = []
    for entry in entries:
        try:
            key, size, checksum = _check_entry(entry)
        except StoreError as e:
            out.append(e.message)
            continue
        obj = core.objects.get(key)
        if obj is not None:
            if not obj.complete:
                out.append("the key is being written")
            elif obj.size_bytes != size or obj.checksum != checksum:
                out.append("the key holds other bytes now")
            else:
                if not any(r.segment == segment for r in obj.ssd_replicas()):
                    _add_ssd(core, obj, seg.host, segment)
                out.append(REGISTERED)
            lost.pop(key, None)
            continue
        if lost.pop(key, None) != (size, checksum):
            out.append("the master does not know the key (removed, or never known)")
            continue
        obj = ObjectMeta(key, size, core._next_generation(), client_id, now_ms,
                         state=ObjectState.COMPLETE, last_access_ms=now_ms,
                         checksum=checksum)
        core.objects.put(obj)
        _add_ssd(core, obj, seg.host, segment)
        out.append(REGISTERED)
    if final:
        core.lost_ssd.pop(holder, None)
    return out


def _add_ssd(core: MasterCore, obj: ObjectMeta, host: str, segment: str) -> None:
    core._replica_id += 1
    obj.replicas.append(Replica(core._replica_id, segment, -1, obj.size_bytes, TIER_SSD,
                                host, complete=True))
    core.ssd_used[segment] += obj.size_bytes
    core.objects.touch(obj.key)


def drop_bad_replicas(core: MasterCore, key: str, generation: int,
                      replica_ids: list[int], now_ms: float) -> int:
    """Drop ``key``'s replicas ``replica_ids`` whose bytes failed the checksum (see module
    docstring); the number dropped (0 when the object or write is gone)."""
    from pymooncake.store.master.core import _Discarded

    obj = core.objects.get(key)
    if obj is None or obj.generation != generation or not obj.complete:
        return 0
    ids = set(replica_ids)
    bad = [r for r in obj.replicas if r.replica_id in ids and r.complete]
    if not bad or not any(r not in bad for r in obj.readable_replicas()):
        return 0  # nothing, or nothing else to read: the last replica stays
    obj.replicas = [r for r in obj.replicas if r not in bad]
    core.objects.touch(key)
    core.replicas_lost = True
    release = now_ms + core.config.default_kv_lease_ttl_ms
    for r in bad:
        if r.segment not in core.pool.segments:
            continue
        if r.tier == TIER_DRAM:
            core._discarded.append(_Discarded([(r.segment, r.addr)], release))
        else:
            core._ssd_forget(r.segment, key, r.length)
    return len(bad)
