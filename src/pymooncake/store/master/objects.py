"""Object table: key → object → replicas → (segment, addr, length, status) (pure).

An object is written in two phases (paper §3.2; Mooncake ``PutStart``/``PutEnd``): it is
``PROCESSING`` from ``put_start`` until ``put_end`` publishes it (``COMPLETE``). Readers
never see a ``PROCESSING`` object. Every write has a fresh ``generation`` number; every
state-changing call must name it (case BUG-18).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, ItemsView, Iterator
from dataclasses import dataclass, field

from pymooncake.store.master.leases import Pin
from pymooncake.store.protocol import TIER_DRAM, TIER_SSD, ReplicaDesc


class ObjectState(enum.Enum):
    PROCESSING = "PROCESSING"
    COMPLETE = "COMPLETE"


@dataclass(slots=True)
class Replica:
    replica_id: int
    segment: str
    addr: int
    length: int
    tier: str = TIER_DRAM
    host: str = ""
    complete: bool = False

    def desc(self) -> ReplicaDesc:
        return ReplicaDesc(self.replica_id, self.segment, self.addr, self.length, self.tier,
                           self.host, "COMPLETE" if self.complete else "PROCESSING")


@dataclass(slots=True)
class ObjectMeta:
    key: str
    size_bytes: int
    generation: int
    writer: str
    put_start_ms: float
    replicas: list[Replica] = field(default_factory=list)
    state: ObjectState = ObjectState.PROCESSING
    pin: Pin = field(default_factory=Pin)
    soft_pin_ttl_ms: float | None = None
    last_access_ms: float = 0.0
    spilling: bool = False
    promoting: bool = False
    checksum: bytes | None = None
    """Per-chunk digests of the object's bytes (``store.checksum``), sent by the writer
    with ``put_end``; every replica is verified against them on read (issue 17)."""
    replica_target: int = 0
    """Replicas the object is meant to have: the count its put got (lowered when an
    eviction keeps only an SSD copy). A failure that drops one below it is repaired by
    ``store.master.rereplication``; 0: unknown (counts as ``replica_count()``)."""

    @property
    def complete(self) -> bool:
        return self.state is ObjectState.COMPLETE

    def dram_replicas(self) -> list[Replica]:
        return [r for r in self.replicas if r.tier == TIER_DRAM]

    def ssd_replicas(self) -> list[Replica]:
        return [r for r in self.replicas if r.tier == TIER_SSD]

    def readable_replicas(self) -> list[Replica]:
        return [r for r in self.replicas if r.complete]

    def replica_count(self) -> int:
        """Segments holding a readable replica (DRAM or SSD: one segment counts once)."""
        return len({r.segment for r in self.replicas if r.complete})


class ObjectTable:
    """``key → ObjectMeta``; also counts objects per key namespace (prefix)."""

    def __init__(self) -> None:
        self._objects: dict[str, ObjectMeta] = {}
        self.namespaces: dict[str, str] = {}
        """Key → its ``namespace_of``, worked out once at ``put`` (the master's gauges
        sum bytes per namespace every second)."""
        self._writing: dict[str, ObjectMeta] = {}
        """Objects put while ``PROCESSING`` (pruned lazily by ``writing``): the master's
        tick looks at these, not at every object, for abandoned writes."""
        self.changed: set[str] | None = None
        """When a set (an HA leader journals its changes): keys put, popped or marked
        with ``touch`` since the journal last took them."""

    def get(self, key: str) -> ObjectMeta | None:
        return self._objects.get(key)

    @property
    def lookup(self) -> Callable[[str], ObjectMeta | None]:
        """``get`` as the table's own bound ``dict.get`` (loops over many keys)."""
        return self._objects.get

    def put(self, obj: ObjectMeta) -> None:
        self._objects[obj.key] = obj
        if obj.key not in self.namespaces:
            self.namespaces[obj.key] = namespace_of(obj.key)
        if obj.state is ObjectState.PROCESSING:
            self._writing[obj.key] = obj
        if self.changed is not None:
            self.changed.add(obj.key)

    def pop(self, key: str) -> ObjectMeta | None:
        if self.changed is not None:
            self.changed.add(key)
        if self._writing:
            self._writing.pop(key, None)
        self.namespaces.pop(key, None)
        return self._objects.pop(key, None)

    def touch(self, key: str) -> None:
        """Record an in-place change of ``key``'s object (state, replicas, pins)."""
        if self.changed is not None:
            self.changed.add(key)

    def __contains__(self, key: str) -> bool:
        return key in self._objects

    def __len__(self) -> int:
        return len(self._objects)

    def __iter__(self) -> Iterator[ObjectMeta]:
        return iter(list(self._objects.values()))

    def items(self) -> ItemsView[str, ObjectMeta]:
        """``(key, object)`` pairs, not copied: the caller must not change the table while
        it iterates."""
        return self._objects.items()

    def writing(self) -> list[ObjectMeta]:
        """The objects still being written (``PROCESSING``), oldest put first, in time
        proportional to the writes in flight rather than to the table: an object leaves
        the list once published (``put_end`` flips its state; states never go back) or
        popped."""
        w = self._writing
        done = [k for k, o in w.items()
                if o.state is not ObjectState.PROCESSING or self._objects.get(k) is not o]
        for k in done:
            del w[k]
        return list(w.values())

    def keys(self) -> list[str]:
        return list(self._objects)


def namespace_of(key: str, separators: str = "/:") -> str:
    """The key's namespace prefix: text before the first ``/`` or ``:`` (``""`` if none)."""
    cut = min((i for i in (key.find(s) for s in separators) if i >= 0), default=-1)
    return key[:cut] if cut > 0 else ""
