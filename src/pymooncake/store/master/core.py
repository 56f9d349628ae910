"""``MasterCore``: the master's whole state machine, pure and synchronous.

This module holds the state, clients and segments, shared helpers, the tick and stats; the
method groups are mixed in from ``core_objects`` (put, read, remove), ``core_eviction`` and
``core_ssd`` (the SSD tier), the state's records from ``core_state``.

It composes the object table, segment pool (allocator), leases/pins and eviction, and is
driven by ``service.py`` with the clock passed into every call (``now_ms``), so every rule
below is tested with a fake clock and no sockets. Errors are ``StoreError`` with Mooncake's
codes. Semantics follow ../shared/MOONCAKE.md "Store semantics" and the field cases:

* two-phase put; readers never see ``PROCESSING`` objects (``REPLICA_IS_NOT_READY``);
* an unfinished put may be taken over after ``put_start_discard_timeout_s`` and its space is
  freed ``put_start_release_timeout_s`` after its ``put_start`` (BUG-17); a client dropped
  for silence has its unfinished puts discarded the same way;
* ``put_end``/``put_revoke`` must name the live generation, else ``INVALID_VERSION``
  (generic ``STALE_HANDLE``, BUG-18);
* one writer wins a key: later ``put_start`` of a present key get ``OBJECT_ALREADY_EXISTS``
  (BUG-19);
* eviction skips leased, hard-pinned, unpublished and moving objects, soft-pinned last;
  an object on a segment with an SSD tier is spilled (a ``SpillOrder`` for the service)
  instead of dropped, and read back by a ``LoadOrder`` on access (BUG-26/27);
* a client silent for ``client_ttl_s`` loses its segments; objects left without replicas
  are dropped, objects with a replica elsewhere survive (BUG-33/34).
"""

from __future__ import annotations

from collections import defaultdict

from pymooncake.store.config import MasterConfig
from pymooncake.store.errors import ErrorCode, StoreError
from pymooncake.store.master import recovery
from pymooncake.store.master.allocator import Segment, SegmentPool
from pymooncake.store.master.core_eviction import EvictionMethods
from pymooncake.store.master.core_objects import ObjectMethods
from pymooncake.store.master.core_ssd import SsdMethods
from pymooncake.store.master.core_state import Effects, _Client, _Discarded, validate_key
from pymooncake.store.master.leases import LeaseTable
from pymooncake.store.master.objects import ObjectMeta, ObjectTable
from pymooncake.store.protocol import TIER_DRAM, TIER_SSD

# re-exported from here: client_master, journal and recovery import them by this path
__all__ = ["Effects", "MasterCore", "_Client", "_Discarded", "validate_key"]


class MasterCore(ObjectMethods, EvictionMethods, SsdMethods):
    """All master state; every public method takes ``now_ms`` (milliseconds)."""

    def __init__(self, config: MasterConfig | None = None) -> None:
        self.config = config or MasterConfig()
        self.objects = ObjectTable()
        self.pool = SegmentPool(self.config.allocation_strategy, self.config.seed)
        self.leases = LeaseTable()
        self.clients: dict[str, _Client] = {}
        self._discarded: list[_Discarded] = []
        self._generation = 0
        self._replica_id = 0
        self.effects = Effects()
        self.spills_in_flight = 0
        self.segments_changed: set[str] | None = None
        """When a set (an HA leader journals changes): segments mounted or unmounted."""
        self.generation_floor = 0
        """Writes with a generation below this began under an earlier leader (HA): their
        ``put_end``/``put_revoke`` answer ``UNAVAILABLE_IN_CURRENT_STATUS`` (retryable)."""
        self.ssd_used: dict[str, int] = defaultdict(int)  # segment → bytes on SSD
        self.replicas_lost = False
        """Set when a published object lost a replica (segment dropped, bad replica): the
        service's ``rereplication`` pass checks the objects and clears it."""
        self.lost_ssd: dict[str, dict[str, tuple[int, bytes | None]]] = {}
        """holder → key → (size, checksum) of objects lost with a dead holder's segment
        while an SSD copy of them lay there: re-created if that holder rejoins with the
        file intact (``recovery``). Deleting the key's object (remove, eviction, a newer
        object of the key later removed) forgets the entry."""

    # -- clients and segments ------------------------------------------------------------

    def _touch(self, client_id: str, now_ms: float) -> _Client:
        c = self.clients.get(client_id)
        if c is None:
            c = self.clients[client_id] = _Client(client_id, now_ms)
        c.last_seen_ms = max(c.last_seen_ms, now_ms)
        return c

    def heartbeat(self, client_id: str, now_ms: float) -> bool:
        """Record a ping. False when the client was unknown (dropped, or master restarted):
        it must re-mount its segments."""
        known = client_id in self.clients
        self._touch(client_id, now_ms)
        return known

    def mount_segment(self, client_id: str, name: str, host: str, base_addr: int,
                      size_bytes: int, now_ms: float, ssd_capacity_bytes: int = 0,
                      rpc_host: str = "", rpc_port: int = 0, holder: str = "") -> None:
        """Mount a segment. ``holder`` (a storage process's SSD identity): a segment of the
        same holder still mounted under another name is its dead previous life (one live
        owner per SSD directory) and is dropped first (``recovery.takeover``)."""
        if not name:
            raise StoreError(ErrorCode.INVALID_PARAMS, "segment name is empty")
        if size_bytes <= 0 or base_addr < 0 or ssd_capacity_bytes < 0:
            raise StoreError(ErrorCode.INVALID_PARAMS,
                             f"segment {name!r}: size_bytes={size_bytes}, base_addr="
                             f"{base_addr}, ssd_capacity_bytes={ssd_capacity_bytes}")
        existing = self.pool.segments.get(name)
        if existing is not None:
            if existing.client_id == client_id and existing.base_addr == base_addr \
                    and existing.size_bytes == size_bytes:
                self._touch(client_id, now_ms)
                return  # idempotent re-mount
            raise StoreError(ErrorCode.SEGMENT_ALREADY_EXISTS, f"segment {name!r} is mounted")
        if holder:
            recovery.takeover(self, holder, name)
        self.pool.mount(Segment(name, client_id, host, base_addr, size_bytes,
                                ssd_capacity_bytes, rpc_host, rpc_port, holder))
        if self.segments_changed is not None:
            self.segments_changed.add(name)
        self._touch(client_id, now_ms).segments.add(name)

    def unmount_segment(self, client_id: str, name: str, now_ms: float) -> int:
        """Unmount; replicas in it are dropped. Returns the number of objects lost."""
        seg = self.pool.segments.get(name)
        if seg is None:
            raise StoreError(ErrorCode.SEGMENT_NOT_FOUND, f"segment {name!r} is not mounted")
        if seg.client_id != client_id:
            raise StoreError(ErrorCode.ILLEGAL_CLIENT,
                             f"segment {name!r} belongs to another client")
        return self._drop_segment(name)

    def _drop_segment(self, name: str) -> int:
        lost = 0
        for obj in self.objects:
            keep = [r for r in obj.replicas if r.segment != name]
            if len(keep) == len(obj.replicas):
                continue
            if not obj.complete:
                self._discard_write(obj, now_ms=None)
                lost += 1
                continue
            had_ssd = any(r.segment == name and r.tier == TIER_SSD for r in obj.replicas)
            obj.replicas = keep
            self.objects.touch(obj.key)
            self.replicas_lost = True
            if not any(r.complete for r in keep):
                self._delete(obj, free_ranges=True)
                if had_ssd:
                    recovery.remember_lost(self, name, obj)
                lost += 1
        self._discarded = [d for d in self._discarded
                           if not all(seg == name for seg, _ in d.ranges)]
        for d in self._discarded:
            d.ranges = [(s, a) for s, a in d.ranges if s != name]
        seg = self.pool.unmount(name)
        if self.segments_changed is not None:
            self.segments_changed.add(name)
        self.ssd_used.pop(name, None)
        c = self.clients.get(seg.client_id)
        if c is not None:
            c.segments.discard(name)
        return lost

    # -- helpers ---------------------------------------------------------------------------

    def _next_generation(self) -> int:
        self._generation += 1
        return self._generation

    def _delete(self, obj: ObjectMeta, free_ranges: bool) -> None:
        if free_ranges:
            for r in obj.replicas:
                if r.tier == TIER_DRAM:
                    self.pool.free(r.segment, r.addr)
                else:
                    self._ssd_forget(r.segment, obj.key, r.length)
        self.objects.pop(obj.key)
        self.leases.drop(obj.key)
        if self.lost_ssd:
            recovery.forget_lost(self, obj.key)

    def _ssd_forget(self, segment: str, key: str, length: int) -> None:
        if segment in self.pool.segments:
            self.ssd_used[segment] -= length
            self.effects.ssd_deletes.append((segment, key))

    def _discard_write(self, obj: ObjectMeta, now_ms: float | None) -> None:
        """Forget an unfinished write; its ranges stay allocated until the release time
        (its writer may still be sending bytes into them)."""
        ranges = [(r.segment, r.addr) for r in obj.replicas if r.tier == TIER_DRAM
                  and r.segment in self.pool.segments]
        release = obj.put_start_ms + self.config.put_start_release_timeout_s * 1000.0
        self._discarded.append(_Discarded(ranges, release))
        self.objects.pop(obj.key)

    def _lookup(self, key: str) -> ObjectMeta:
        validate_key(key, self.config.max_key_bytes)
        obj = self.objects.get(key)
        if obj is None:
            raise StoreError(ErrorCode.OBJECT_NOT_FOUND, f"key {key!r} not found")
        return obj

    # -- time ------------------------------------------------------------------------------

    def tick(self, now_ms: float) -> None:
        """Periodic work: drop silent clients, reclaim abandoned writes, free discarded
        ranges, expire leases, run the watermark eviction pass."""
        ttl_ms = self.config.client_ttl_s * 1000.0
        for c in list(self.clients.values()):
            if now_ms - c.last_seen_ms > ttl_ms:
                for name in list(c.segments):
                    self._drop_segment(name)
                for obj in self.objects.writing():
                    if obj.writer == c.client_id:
                        self._discard_write(obj, None)
                del self.clients[c.client_id]
                self.effects.dropped_clients.append(c.client_id)
        release_ms = self.config.put_start_release_timeout_s * 1000.0
        for obj in self.objects.writing():   # (every 0.1 s: never a scan of all objects)
            if now_ms - obj.put_start_ms >= release_ms:
                self._discard_write(obj, None)
        keep = []
        for d in self._discarded:
            if now_ms >= d.release_ms:
                for seg, addr in d.ranges:
                    self.pool.free(seg, addr)
            else:
                keep.append(d)
        self._discarded = keep
        self.leases.expire(now_ms)
        self.watermark_pass(now_ms)

    def drain_effects(self) -> Effects:
        eff, self.effects = self.effects, Effects()
        return eff

    # -- stats -----------------------------------------------------------------------------

    def stats(self, now_ms: float) -> dict[str, object]:
        per_ns: dict[str, int] = defaultdict(int)
        num_soft = num_hard = 0
        ns_of = self.objects.namespaces
        for key, obj in self.objects.items():
            if obj.complete:
                per_ns[ns_of[key]] += obj.size_bytes * len(obj.replicas)
                num_hard += obj.pin.hard
                num_soft += obj.pin.soft_pinned(now_ms)
        return {
            "num_objects": len(self.objects),
            "num_segments": len(self.pool.segments),
            "num_clients": len(self.clients),
            "dram_capacity_bytes": self.pool.capacity_bytes(),
            "dram_used_bytes": self.pool.used_bytes(),
            "ssd_used_bytes": sum(self.ssd_used.values()),
            "num_leased": self.leases.num_leased(now_ms),
            "num_soft_pinned": num_soft,
            "num_hard_pinned": num_hard,
            "bytes_per_namespace": dict(per_ns),
            "fragmentation": {n: s.allocator.fragmentation()
                              for n, s in self.pool.segments.items()},
        }
