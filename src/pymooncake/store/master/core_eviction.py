"""Eviction from DRAM: the methods of ``MasterCore`` that pick and evict objects.

Mixed into ``MasterCore`` (``core.py``). The choice of victims is ``eviction``'s pure
policy; this part finds the candidates (skipping leased, hard-pinned, unpublished and moving
objects) and evicts each: spilled to its segment's SSD tier when one can take it (a
``SpillOrder`` in ``effects`` for the service), else dropped.
"""

from __future__ import annotations

from pymooncake.store.config import MasterConfig
from pymooncake.store.master import eviction
from pymooncake.store.master.allocator import SegmentPool
from pymooncake.store.master.core_state import Effects
from pymooncake.store.master.leases import LeaseTable
from pymooncake.store.master.objects import ObjectTable
from pymooncake.store.protocol import SpillOrder


class EvictionMethods:
    """Mixed into ``MasterCore``: candidates, per-object eviction, the watermark pass."""

    config: MasterConfig
    objects: ObjectTable
    pool: SegmentPool
    leases: LeaseTable
    effects: Effects

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
