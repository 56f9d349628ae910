"""``MasterCore``: the master's whole state machine, pure and synchronous.

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
from dataclasses import dataclass, field

from pymooncake.store.checksum import describe, well_formed
from pymooncake.store.config import MasterConfig, ReplicateConfig
from pymooncake.store.errors import ErrorCode, StoreError
from pymooncake.store.master import eviction, recovery
from pymooncake.store.master.allocator import Segment, SegmentPool
from pymooncake.store.master.leases import LeaseTable, soft_pin_deadline
from pymooncake.store.master.objects import (
    ObjectMeta,
    ObjectState,
    ObjectTable,
    Replica,
)
from pymooncake.store.protocol import (
    TIER_DRAM,
    TIER_SSD,
    LoadOrder,
    PutHandle,
    ReplicaList,
    SpillOrder,
)


@dataclass(slots=True)
class _Discarded:
    """Space of a taken-over or abandoned put, freed at ``release_ms``."""

    ranges: list[tuple[str, int]]
    release_ms: float


@dataclass(slots=True)
class Effects:
    """Work for the I/O shell produced by a call (drained by the service)."""

    spills: list[SpillOrder] = field(default_factory=list)
    ssd_deletes: list[tuple[str, str]] = field(default_factory=list)  # (segment, key)
    evicted: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # reason → n
    dropped_clients: list[str] = field(default_factory=list)
    stalled_passes: int = 0  # watermark passes over the watermark that found no candidate


@dataclass(slots=True)
class _Client:
    client_id: str
    last_seen_ms: float
    segments: set[str] = field(default_factory=set)


def validate_key(key: object, max_key_bytes: int) -> str:
    """The key, or ``StoreError(INVALID_KEY)`` for a non-str, empty or too long key."""
    if not isinstance(key, str):
        raise StoreError(ErrorCode.INVALID_KEY, f"key must be str, got {type(key).__name__}")
    if not key:
        raise StoreError(ErrorCode.INVALID_KEY, "empty key")
    n = len(key.encode("utf-8", "surrogatepass"))
    if n > max_key_bytes:
        raise StoreError(ErrorCode.INVALID_KEY, f"key of {n} bytes exceeds {max_key_bytes}")
    return key


class MasterCore:
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

    # -- put -------------------------------------------------------------------------------

    def put_start(self, client_id: str, key: str, size_bytes: int,
                  config: ReplicateConfig, now_ms: float) -> PutHandle:
        """See ``start_write``; returns the handle as a message."""
        obj = self.start_write(client_id, key, size_bytes, config, now_ms)
        return PutHandle(key, obj.generation, size_bytes, tuple(r.desc() for r in obj.replicas))

    def start_write(self, client_id: str, key: str, size_bytes: int,
                    config: ReplicateConfig, now_ms: float) -> ObjectMeta:
        """Allocate ``size_bytes`` on up to ``config.replica_num`` distinct segments.

        Raises ``INVALID_KEY``/``INVALID_PARAMS`` for bad input, ``OBJECT_ALREADY_EXISTS``
        when the key is published or being written (and not yet past the discard
        timeout), ``NO_AVAILABLE_HANDLE`` when no segment has room even after evicting.
        """
        validate_key(key, self.config.max_key_bytes)
        if isinstance(size_bytes, bool) or not isinstance(size_bytes, int) or size_bytes <= 0:
            raise StoreError(ErrorCode.INVALID_PARAMS,
                             f"size_bytes={size_bytes!r}: must be an int > 0")
        if not isinstance(config, ReplicateConfig):
            raise StoreError(ErrorCode.INVALID_PARAMS, "config must be a ReplicateConfig")
        self._touch(client_id, now_ms)
        existing = self.objects.get(key)
        if existing is not None:
            age_ms = now_ms - existing.put_start_ms
            if existing.complete or age_ms < self.config.put_start_discard_timeout_s * 1000.0:
                raise StoreError(ErrorCode.OBJECT_ALREADY_EXISTS,
                                 f"key {key!r} exists ({existing.state.value})")
            self._discard_write(existing, now_ms)
        largest = max((s.allocator.capacity_bytes for s in self.pool.segments.values()),
                      default=0)
        if size_bytes > largest:
            raise StoreError(ErrorCode.INVALID_PARAMS if largest else
                             ErrorCode.NO_AVAILABLE_HANDLE,
                             f"value of {size_bytes} bytes is larger than every mounted "
                             f"segment (largest {largest} bytes)")
        placed = self.pool.place(size_bytes, config.replica_num, client_id,
                                 config.preferred_segment)
        if not placed:
            self._evict_for(size_bytes, now_ms)
            placed = self.pool.place(size_bytes, config.replica_num, client_id,
                                     config.preferred_segment)
        if not placed:
            raise StoreError(ErrorCode.NO_AVAILABLE_HANDLE,
                             f"no segment has {size_bytes} free bytes for {key!r}")
        gen = self._next_generation()
        obj = ObjectMeta(key, size_bytes, gen, client_id, now_ms,
                         last_access_ms=now_ms, replica_target=len(placed))
        obj.pin.hard = config.hard_pin
        if config.soft_pin:
            obj.soft_pin_ttl_ms = (config.soft_pin_ttl_ms if config.soft_pin_ttl_ms is not None
                                   else self.config.default_kv_soft_pin_ttl_ms)
        for seg, addr in placed:
            self._replica_id += 1
            obj.replicas.append(Replica(self._replica_id, seg.name, addr, size_bytes,
                                        TIER_DRAM, seg.host))
        self.objects.put(obj)
        return obj

    def _live_write(self, client_id: str, key: str, generation: int) -> ObjectMeta:
        validate_key(key, self.config.max_key_bytes)
        obj = self.objects.get(key)
        if generation < self.generation_floor and (obj is None or obj.generation != generation):
            raise StoreError(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS,
                             f"{key!r} generation {generation} was started under an earlier "
                             "master leader and did not survive the fail-over; put it again")
        if obj is None or obj.generation != generation or obj.complete:
            state = ("absent" if obj is None else
                     f"generation {obj.generation} {obj.state.value}")
            raise StoreError(ErrorCode.INVALID_VERSION,
                             f"stale handle: {key!r} generation {generation} is not the "
                             f"write in progress ({state})")
        if obj.writer != client_id:
            raise StoreError(ErrorCode.ILLEGAL_CLIENT,
                             f"{key!r} generation {generation} belongs to another client")
        return obj

    def put_end(self, client_id: str, key: str, generation: int, now_ms: float,
                checksum: bytes | None = None) -> None:
        """Publish write ``generation`` of ``key`` (``INVALID_VERSION`` when stale) with the
        writer's ``checksum`` of its bytes (``store.checksum``: an algorithm byte and a
        digest per chunk; ``INVALID_PARAMS`` when it has the wrong type or length). An object
        published without one never verifies on read (issue 17).

        Idempotent for its writer: a ``put_end`` of the generation already published by
        the same client succeeds again (a retry after the answer was lost in a fail-over)."""
        done = self.objects.get(key)
        if done is not None and done.complete and done.generation == generation \
                and done.writer == client_id and isinstance(key, str):
            return
        obj = self._live_write(client_id, key, generation)
        if checksum is not None and not well_formed(checksum, obj.size_bytes):
            got = (f"{len(checksum)} bytes" if isinstance(checksum, bytes)
                   else type(checksum).__name__)
            raise StoreError(ErrorCode.INVALID_PARAMS, f"{key!r}: checksum must be "
                             f"{describe(obj.size_bytes)}, got {got}")
        obj.checksum = checksum
        self._touch(client_id, now_ms)
        obj.state = ObjectState.COMPLETE
        self.objects.touch(key)
        for r in obj.replicas:
            r.complete = True
        obj.last_access_ms = now_ms
        if obj.soft_pin_ttl_ms is not None:
            obj.pin.soft_deadline_ms = soft_pin_deadline(now_ms, obj.soft_pin_ttl_ms)

    def put_revoke(self, client_id: str, key: str, generation: int, now_ms: float) -> None:
        """Undo write ``generation`` of ``key``: its space is freed at once."""
        obj = self._live_write(client_id, key, generation)
        self._touch(client_id, now_ms)
        self._delete(obj, free_ranges=True)

    # -- read ------------------------------------------------------------------------------

    def get_replica_list(self, client_id: str, key: str, now_ms: float) -> ReplicaList:
        """Readable replicas of ``key`` and a read lease. ``OBJECT_NOT_FOUND`` when absent,
        ``REPLICA_IS_NOT_READY`` while being written. An object only on SSD is returned
        with SSD replicas; the service loads it back first (``promote``)."""
        obj = self.read_object(client_id, key, now_ms)
        return ReplicaList(key, obj.size_bytes, obj.generation,
                           tuple(r.desc() for r in obj.readable_replicas()),
                           self.config.default_kv_lease_ttl_ms, obj.checksum)

    def read_object(self, client_id: str, key: str, now_ms: float) -> ObjectMeta:
        """``get_replica_list`` without building the answer (the service's fast path)."""
        obj = self._lookup(key)
        if not obj.complete:
            raise StoreError(ErrorCode.REPLICA_IS_NOT_READY, f"key {key!r} is being written")
        self.leases.grant(key, client_id, now_ms, self.config.default_kv_lease_ttl_ms)
        obj.last_access_ms = now_ms
        return obj

    def exist(self, client_id: str, key: str, now_ms: float,
              exclude_segments: frozenset[str] = frozenset()) -> bool:
        """True for a published object. It refreshes the object's LRU recency but grants
        **no read lease** — no bytes are read, and a poller's leases would otherwise keep a
        full store from evicting anything (case BUG-16; Mooncake's ``ExistKey`` leases).
        False when every readable replica lies on one of ``exclude_segments`` (segments the
        caller knows have failed, case BUG-34)."""
        validate_key(key, self.config.max_key_bytes)
        obj = self.objects.get(key)
        if obj is None or not obj.complete:
            return False
        if exclude_segments and all(r.segment in exclude_segments
                                    for r in obj.readable_replicas()):
            return False
        obj.last_access_ms = max(obj.last_access_ms, now_ms)
        return True

    def release_leases(self, client_id: str, keys: list[str]) -> int:
        """Drop ``client_id``'s leases on ``keys`` (the "unlock" of a read); count dropped."""
        return sum(self.leases.release(k, client_id) for k in keys)

    def lease_count(self, key: str, now_ms: float) -> int:
        return self.leases.count(key, now_ms)

    def list_keys(self) -> list[str]:
        """Published keys, each readable from DRAM or SSD (case BUG-27)."""
        return [o.key for o in self.objects if o.complete and o.readable_replicas()]

    # -- remove ----------------------------------------------------------------------------

    def remove(self, key: str, now_ms: float, force: bool = False) -> None:
        """``OBJECT_NOT_FOUND``; ``REPLICA_IS_NOT_READY`` while written (refused);
        ``OBJECT_HAS_LEASE`` while a read lease is held (unless ``force``). A removed key
        is never re-created by its dead holder's rejoin (``recovery``)."""
        if self.lost_ssd:
            recovery.forget_lost(self, validate_key(key, self.config.max_key_bytes))
        obj = self._lookup(key)
        if not obj.complete:
            raise StoreError(ErrorCode.REPLICA_IS_NOT_READY,
                             f"key {key!r} is being written; remove refused")
        if not force and self.leases.is_leased(key, now_ms):
            raise StoreError(ErrorCode.OBJECT_HAS_LEASE,
                             f"key {key!r} is in use (read lease held)")
        if (obj.spilling or obj.promoting) and not force:
            raise StoreError(ErrorCode.OBJECT_HAS_LEASE,
                             f"key {key!r} is moving between tiers")
        self._delete(obj, free_ranges=True)

    def remove_all(self, now_ms: float, force: bool = False) -> int:
        self.lost_ssd.clear()  # no dead holder brings a removed key back (``recovery``)
        n = 0
        for obj in self.objects:
            if not obj.complete or obj.spilling or obj.promoting:
                continue
            if not force and self.leases.is_leased(obj.key, now_ms):
                continue
            self._delete(obj, free_ranges=True)
            n += 1
        return n

    # -- eviction --------------------------------------------------------------------------

    def _candidates(self, now_ms: float, segments: set[str] | None = None
                    ) -> list[eviction.Candidate]:
        out = []
        for obj in self.objects:
            if not obj.complete or obj.pin.hard or obj.spilling or obj.promoting:
                continue
            if self.leases.is_leased(obj.key, now_ms):
                continue
            dram = obj.dram_replicas()
            if not dram:
                continue
            if segments is not None and not any(r.segment in segments for r in dram):
                continue
            out.append(eviction.Candidate(obj.key, obj.size_bytes * len(dram),
                                          obj.last_access_ms, obj.pin.soft_pinned(now_ms)))
        return out

    def _evict(self, key: str, reason: str) -> None:
        """Evict ``key`` from DRAM: spill to an SSD tier when one can take it, else drop."""
        obj = self.objects.get(key)
        assert obj is not None
        self.effects.evicted[reason] += 1
        if not obj.ssd_replicas():
            for r in obj.dram_replicas():
                seg = self.pool.segments.get(r.segment)
                if seg is not None and seg.ssd_capacity_bytes >= obj.size_bytes:
                    obj.spilling = True
                    self.effects.spills.append(SpillOrder(key, obj.generation, r.segment,
                                                          r.addr, obj.size_bytes))
                    return
            self._delete(obj, free_ranges=True)
            return
        for r in obj.dram_replicas():  # an SSD copy exists: drop the DRAM copies only
            self.pool.free(r.segment, r.addr)
        obj.replicas = obj.ssd_replicas()
        obj.replica_target = obj.replica_count()  # evicted on purpose: not a loss
        self.objects.touch(key)

    def evict(self, need_bytes: int, now_ms: float, reason: str = eviction.EVICT_REASON_NO_SPACE
              ) -> list[str]:
        """Evict least-recently-used eligible objects until ``need_bytes`` are freed."""
        victims = eviction.select_victims(self._candidates(now_ms), need_bytes)
        for key in victims:
            self._evict(key, reason)
        return victims

    def _evict_for(self, size_bytes: int, now_ms: float, segment: str | None = None) -> None:
        """After a failed placement: evict LRU objects per segment until one range fits
        (spills only free space when the service reports them done). ``segment``: make
        room there only (a load from SSD must land in its owner's segment)."""
        segs = [self.pool.segments[segment]] if segment is not None else sorted(
            self.pool.segments.values(), key=lambda s: -s.free_ratio)
        for seg in segs:
            if seg.allocator.capacity_bytes < size_bytes:
                continue
            cands = eviction.order_candidates(self._candidates(now_ms, {seg.name}))
            pending = 0  # bytes that spills in flight will free
            for c in cands:
                if seg.allocator.largest_free_bytes() + pending >= size_bytes:
                    return
                self._evict(c.key, eviction.EVICT_REASON_NO_SPACE)
                obj = self.objects.get(c.key)
                if obj is not None and obj.spilling:
                    pending += obj.size_bytes
            if seg.allocator.largest_free_bytes() + pending >= size_bytes:
                return

    def watermark_pass(self, now_ms: float) -> list[str]:
        """Evict when used/capacity is over the high watermark: ``ceil(eviction_ratio ×
        candidates)`` objects (only objects with an evictable DRAM replica count, case
        BUG-62), and at least enough bytes to get back under the watermark. A pass over the
        watermark that finds no candidate is counted (``effects.stalled_passes``) so a
        full, all-leased store is visible (case BUG-16)."""
        used, cap = self.pool.used_bytes(), self.pool.capacity_bytes()
        hw = self.config.eviction_high_watermark_ratio
        if cap <= 0 or used <= hw * cap:
            return []
        over = used - int(hw * cap)
        cands = self._candidates(now_ms)
        if not cands:
            self.effects.stalled_passes += 1
            return []
        victims = eviction.select_victims(
            cands, over, eviction.target_count(len(cands), self.config.eviction_ratio))
        for key in victims:
            self._evict(key, eviction.EVICT_REASON_WATERMARK)
        return victims

    # -- SSD tier --------------------------------------------------------------------------

    def spill_done(self, key: str, generation: int, segment: str, ok: bool,
                   ssd_dropped: list[str] = (), now_ms: float = 0.0) -> bool:
        """The service finished a ``SpillOrder``. Returns False when the object is gone
        (the caller must delete the SSD file).

        A reader may have leased the object while it was being copied to SSD: its DRAM
        range is then kept until a later eviction finds it unleased (never freed under a
        reader's feet)."""
        for k in ssd_dropped:
            self._forget_ssd_replica(segment, k)
        obj = self.objects.get(key)
        if obj is None or obj.generation != generation:
            return False
        obj.spilling = False
        leased = self.leases.is_leased(key, now_ms)
        if not ok or segment not in self.pool.segments:
            if segment in self.pool.segments and not leased:  # a failed spill: plain eviction
                self._delete(obj, free_ranges=True)
            return False
        seg = self.pool.segments[segment]
        self._replica_id += 1
        ssd = Replica(self._replica_id, segment, -1, obj.size_bytes, TIER_SSD, seg.host,
                      complete=True)
        self.objects.touch(key)
        if leased:
            obj.replicas.append(ssd)
        else:
            for r in obj.dram_replicas():
                self.pool.free(r.segment, r.addr)
            obj.replicas = [ssd]
            obj.replica_target = 1  # evicted on purpose: not a loss
        self.ssd_used[segment] += obj.size_bytes
        return True

    def _forget_ssd_replica(self, segment: str, key: str) -> None:
        obj = self.objects.get(key)
        if obj is None:
            return
        ssd = [r for r in obj.ssd_replicas() if r.segment == segment]
        if not ssd:
            return
        self.ssd_used[segment] -= obj.size_bytes
        obj.replicas = [r for r in obj.replicas if r not in ssd]
        self.objects.touch(key)
        if not obj.readable_replicas() and obj.complete:
            self.objects.pop(key)
            self.leases.drop(key)

    def promote_start(self, key: str, now_ms: float) -> LoadOrder | None:
        """Reserve DRAM on the SSD owner's segment for loading ``key`` back.

        None when the object already has a DRAM replica. ``NO_AVAILABLE_HANDLE`` when no
        room can be made; ``REPLICA_IS_NOT_READY`` while another load is running."""
        obj = self._lookup(key)
        if obj.dram_replicas():
            return None
        if obj.promoting:
            raise StoreError(ErrorCode.REPLICA_IS_NOT_READY, f"{key!r} is being loaded")
        ssd = obj.ssd_replicas()
        if not ssd:
            raise StoreError(ErrorCode.OBJECT_NOT_FOUND, f"{key!r} has no replica")
        seg = self.pool.segments[ssd[0].segment]
        off = seg.allocator.allocate(obj.size_bytes)
        if off is None:
            self._evict_for(obj.size_bytes, now_ms, seg.name)
            off = seg.allocator.allocate(obj.size_bytes)
        if off is None:
            raise StoreError(ErrorCode.NO_AVAILABLE_HANDLE,
                             f"no DRAM room in {seg.name!r} to load {key!r} from SSD")
        obj.promoting = True
        self.objects.touch(key)
        addr = seg.base_addr + off
        self._replica_id += 1
        obj.replicas.append(Replica(self._replica_id, seg.name, addr, obj.size_bytes,
                                    TIER_DRAM, seg.host, complete=False))
        return LoadOrder(key, obj.generation, seg.name, addr, obj.size_bytes)

    def promote_done(self, order: LoadOrder, ok: bool, now_ms: float) -> None:
        obj = self.objects.get(order.key)
        if obj is None or obj.generation != order.generation:
            self.pool.free(order.segment, order.addr)
            return
        obj.promoting = False
        self.objects.touch(order.key)
        target = [r for r in obj.replicas if r.tier == TIER_DRAM and r.addr == order.addr
                  and r.segment == order.segment]
        if not ok:
            for r in target:
                self.pool.free(r.segment, r.addr)
            obj.replicas = [r for r in obj.replicas if r not in target]
            self._forget_ssd_replica(order.segment, order.key)
            return
        for r in target:
            r.complete = True
        obj.last_access_ms = now_ms

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
