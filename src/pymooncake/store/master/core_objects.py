"""Put, read and remove of objects: the methods of ``MasterCore`` a client's calls reach.

Mixed into ``MasterCore`` (``core.py``), whose state and helpers (``_touch``, ``_lookup``,
``_delete``, ``_discard_write``, ``_next_generation``) and eviction (``_evict_for``,
``core_eviction``) they use. Every method takes ``now_ms`` (milliseconds) and raises
``StoreError`` with Mooncake's codes.
"""

from __future__ import annotations

from pymooncake.store.checksum import describe, well_formed
from pymooncake.store.config import MasterConfig, ReplicateConfig
from pymooncake.store.errors import ErrorCode, StoreError
from pymooncake.store.master import recovery
from pymooncake.store.master.allocator import SegmentPool
from pymooncake.store.master.core_state import keys_fast_ok, validate_key
from pymooncake.store.master.leases import LeaseTable, soft_pin_deadline
from pymooncake.store.master.objects import ObjectMeta, ObjectState, ObjectTable, Replica
from pymooncake.store.protocol import TIER_DRAM, PutHandle, ReplicaList

_COMPLETE = ObjectState.COMPLETE


class ObjectMethods:
    """Mixed into ``MasterCore``: two-phase put, reads (with read leases), removes."""

    config: MasterConfig
    objects: ObjectTable
    pool: SegmentPool
    leases: LeaseTable
    generation_floor: int
    lost_ssd: dict[str, dict[str, tuple[int, bytes | None]]]

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

    def exist_many(self, keys: tuple[str, ...] | list[str], now_ms: float,
                   exclude_segments: frozenset[str] = frozenset()) -> list[bool | StoreError]:
        """``exist`` of each key (``batch_exist``): its answer, or the ``StoreError`` a bad
        key gets. One loop with the key checks done for all keys at once when they all
        pass (ASCII, 1 to ``max_key_bytes`` characters: the usual case)."""
        limit = self.config.max_key_bytes
        lookup = self.objects.lookup
        checked = keys_fast_ok(keys, limit)
        done = ObjectState.COMPLETE
        out: list[bool | StoreError] = []
        if checked and not exclude_segments:  # the usual case: one lookup pass in C
            for obj in map(lookup, keys):
                if obj is None or obj.state is not done:
                    out.append(False)
                    continue
                if obj.last_access_ms < now_ms:
                    obj.last_access_ms = now_ms
                out.append(True)
            return out
        for k in keys:
            if not checked:
                try:
                    validate_key(k, limit)
                except StoreError as e:
                    out.append(e)
                    continue
            obj = lookup(k)
            if obj is None or obj.state is not done or (
                    exclude_segments and all(r.segment in exclude_segments
                                             for r in obj.readable_replicas())):
                out.append(False)
            else:
                if obj.last_access_ms < now_ms:
                    obj.last_access_ms = now_ms
                out.append(True)
        return out

    def size_of(self, key: str, now_ms: float,
                exclude_segments: frozenset[str] = frozenset()) -> int:
        """The size of a published object, from DRAM or SSD (``get_size``): as ``exist``,
        no read lease (no bytes are read) and its LRU recency refreshed.
        ``OBJECT_NOT_FOUND`` when missing or every readable replica lies on one of
        ``exclude_segments``; ``REPLICA_IS_NOT_READY`` while it is written."""
        obj = self._lookup(key)
        if not obj.complete:
            raise StoreError(ErrorCode.REPLICA_IS_NOT_READY, f"key {key!r} is being written")
        if exclude_segments and all(r.segment in exclude_segments
                                    for r in obj.readable_replicas()):
            raise StoreError(ErrorCode.OBJECT_NOT_FOUND, f"{key!r}: no reachable replica")
        obj.last_access_ms = max(obj.last_access_ms, now_ms)
        return obj.size_bytes

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
        self.finish_remove(self.removable(key, now_ms, force))

    def finish_remove(self, obj: ObjectMeta) -> None:
        """Forget ``obj`` — a ``removable`` answer, nothing changed since — and free its
        ranges: the second half of ``remove``, which the live master runs after its answer
        is sent (``RpcServer.after_reply``). A no-op when ``obj.key`` no longer names ``obj``."""
        if self.objects.get(obj.key) is obj:
            self._delete(obj, free_ranges=True)

    def removable(self, key: str, now_ms: float, force: bool = False) -> ObjectMeta:
        """The checks of ``remove`` (same errors), changing nothing but the lost-SSD list;
        returns the object that ``finish_remove`` then deletes."""
        if self.lost_ssd:
            recovery.forget_lost(self, validate_key(key, self.config.max_key_bytes))
        obj = self._lookup(key)
        if obj.state is not _COMPLETE:
            raise StoreError(ErrorCode.REPLICA_IS_NOT_READY,
                             f"key {key!r} is being written; remove refused")
        if not force and self.leases.is_leased(key, now_ms):
            raise StoreError(ErrorCode.OBJECT_HAS_LEASE,
                             f"key {key!r} is in use (read lease held)")
        if (obj.spilling or obj.promoting) and not force:
            raise StoreError(ErrorCode.OBJECT_HAS_LEASE,
                             f"key {key!r} is moving between tiers")
        return obj

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
