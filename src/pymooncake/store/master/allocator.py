"""Mounted segments and replica placement (pure).

Every mounted segment gets an ``OffsetAllocator`` over its ``size_bytes``; the master
allocates absolute addresses ``base_addr + offset`` that clients write with the Transfer
Engine. ``place`` puts ``replica_num`` replicas on *distinct* segments, distinct hosts
first (case BUG-33), best effort: with fewer usable segments it returns fewer replicas, and
``[]`` when none fits. Strategies (``MasterConfig.allocation_strategy``):

* ``random`` – a seeded random order;
* ``free_ratio_first`` – segments with the largest free share first;
* ``local_first`` – the writer's own segments first, then random.

A ``preferred_segment`` always comes first when it fits.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from pymooncake.store.tiers.dram_segment import OffsetAllocator


@dataclass(slots=True)
class Segment:
    """One mounted segment (a storage process's registered DRAM buffer)."""

    name: str
    client_id: str
    host: str
    base_addr: int
    size_bytes: int
    ssd_capacity_bytes: int = 0
    rpc_host: str = ""
    rpc_port: int = 0
    holder: str = ""  # the storage process's SSD directory identity (issue 17: rejoin)
    allocator: OffsetAllocator = field(init=False)

    def __post_init__(self) -> None:
        self.allocator = OffsetAllocator(self.size_bytes)

    @property
    def used_bytes(self) -> int:
        return self.allocator.used_bytes

    @property
    def free_ratio(self) -> float:
        cap = self.allocator.capacity_bytes
        return self.allocator.free_bytes / cap if cap else 0.0


class SegmentPool:
    """The mounted segments, by name."""

    def __init__(self, strategy: str = "random", seed: int = 0) -> None:
        self.strategy = strategy
        self.segments: dict[str, Segment] = {}
        self._rng = random.Random(seed)

    def mount(self, seg: Segment) -> None:
        if seg.name in self.segments:
            raise KeyError(seg.name)
        self.segments[seg.name] = seg

    def unmount(self, name: str) -> Segment:
        return self.segments.pop(name)

    def capacity_bytes(self) -> int:
        return sum(s.allocator.capacity_bytes for s in self.segments.values())

    def used_bytes(self) -> int:
        return sum(s.used_bytes for s in self.segments.values())

    def order(self, client_id: str, preferred: str = "") -> list[Segment]:
        """Segments in the order the strategy tries them."""
        segs = list(self.segments.values())
        if self.strategy == "free_ratio_first":
            segs.sort(key=lambda s: (-s.free_ratio, s.name))
        else:
            segs.sort(key=lambda s: s.name)
            self._rng.shuffle(segs)
            if self.strategy == "local_first":
                segs.sort(key=lambda s: s.client_id != client_id)  # stable: locals first
        if preferred and preferred in self.segments:
            segs.sort(key=lambda s: s.name != preferred)
        return segs

    def place(self, size_bytes: int, replica_num: int, client_id: str,
              preferred: str = "") -> list[tuple[Segment, int]]:
        """Allocate ``size_bytes`` on up to ``replica_num`` distinct segments.

        Returns ``[(segment, absolute_addr), ...]`` (possibly fewer than asked, ``[]`` when
        nothing fits). Nothing stays allocated when the result is ``[]``.
        """
        ordered = self.order(client_id, preferred)
        fitting = [s for s in ordered if s.allocator.free_bytes >= size_bytes]
        chosen: list[tuple[Segment, int]] = []
        hosts: set[str] = set()
        # first pass: one segment per host; second pass: any remaining segment
        for pass_distinct in (True, False):
            for seg in fitting:
                if len(chosen) >= replica_num:
                    return chosen
                if any(seg is c for c, _ in chosen):
                    continue
                if pass_distinct and seg.host in hosts:
                    continue
                off = seg.allocator.allocate(size_bytes)
                if off is None:
                    continue
                chosen.append((seg, seg.base_addr + off))
                hosts.add(seg.host)
        return chosen

    def free(self, segment: str, addr: int) -> None:
        seg = self.segments.get(segment)
        if seg is not None:
            seg.allocator.free(addr - seg.base_addr)
