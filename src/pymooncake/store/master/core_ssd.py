"""The SSD tier: the methods of ``MasterCore`` that finish spills and load objects back.

Mixed into ``MasterCore`` (``core.py``). The service carries out a ``SpillOrder`` or a
``LoadOrder`` by RPC to the storage process that owns the segment and reports the outcome
here (``spill_done``, ``promote_done``); ``promote_start`` reserves the DRAM a load lands in.
"""

from __future__ import annotations

from pymooncake.store.errors import ErrorCode, StoreError
from pymooncake.store.master.allocator import SegmentPool
from pymooncake.store.master.leases import LeaseTable
from pymooncake.store.master.objects import ObjectTable, Replica
from pymooncake.store.protocol import TIER_DRAM, TIER_SSD, LoadOrder


class SsdMethods:
    """Mixed into ``MasterCore``: spill outcomes and loads back into DRAM (promotion)."""

    objects: ObjectTable
    pool: SegmentPool
    leases: LeaseTable
    ssd_used: dict[str, int]
    _replica_id: int

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
