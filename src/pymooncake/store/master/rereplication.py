"""Re-replication: an object that lost a replica to a failure gets it back (issue 17).

Every object records the replicas it is meant to have (``ObjectMeta.replica_target``: the
count its put got; journaled, so a new HA leader knows it too). When a failure takes one
away — a holder's segment dropped (silence past ``client_ttl``, unmount, takeover) or a
replica reported bad — the core sets ``replicas_lost`` and the service runs passes until
every repairable object is back at its target. A pass (``plan``, pure) picks objects

* published, at rest (not spilling, loading or being copied), with fewer segments
  holding a readable replica (DRAM or SSD) than their target, and a readable DRAM
  replica to copy from;
* hard-pinned first, then most recently used first;
* up to ``budget_bytes`` (always at least one object), so a big loss does not flood the
  network: the next pass follows ``interval_s`` later;

and for each a new holder: a mounted segment holding no replica of it, on a host none of
its replicas is on when there is one, with room (most free first). The copy itself is the
hot-block copy (``store.master.copier``): the new replica is ``PROCESSING`` — never read —
until its bytes were read from the surviving replica, verified against the checksum
recorded at the put (which stays the object's checksum), and written; then it is
published (``store.master.rereplicator`` runs the passes; a key whose copy failed
``MAX_TRIES`` times is left alone until the next failure).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pymooncake.store.protocol import TIER_DRAM

if TYPE_CHECKING:
    from pymooncake.store.master.core import MasterCore
    from pymooncake.store.master.objects import ObjectMeta

@dataclass(slots=True)
class Plan:
    copies: dict[str, list[str]]
    """target segment → keys to copy there"""
    under_replicated: int
    """objects below their target (repairable now or not)"""
    more: bool
    """repairable objects were left for the next pass (budget)"""


def _under(obj: ObjectMeta) -> bool:
    return obj.complete and 0 < obj.replica_count() < obj.replica_target


def _target(core: MasterCore, obj: ObjectMeta, planned: dict[str, int]) -> str | None:
    """A segment for one more replica of ``obj`` (module docstring), or None."""
    held = {r.segment for r in obj.replicas}
    hosts = {r.host for r in obj.replicas}
    best: tuple[tuple[bool, int], str] | None = None
    for seg in core.pool.segments.values():
        if seg.name in held:
            continue
        free = seg.allocator.largest_free_bytes() - planned.get(seg.name, 0)
        if free < obj.size_bytes:
            continue
        rank = (seg.host not in hosts, free)
        if best is None or rank > best[0]:
            best = (rank, seg.name)
    return None if best is None else best[1]


def plan(core: MasterCore, budget_bytes: int, skip: frozenset[str] = frozenset()) -> Plan:
    """The copies of one pass (module docstring); ``skip``: keys not to try now."""
    under = [o for o in core.objects if _under(o)]
    todo = sorted((o for o in under if o.key not in skip and not o.spilling
                   and not o.promoting and all(r.complete for r in o.replicas)
                   and any(r.tier == TIER_DRAM for r in o.replicas)),
                  key=lambda o: (not o.pin.hard, -o.last_access_ms))
    copies: dict[str, list[str]] = {}
    planned: dict[str, int] = {}
    spent = 0
    more = False
    for obj in todo:
        if copies and spent + obj.size_bytes > budget_bytes:
            more = True
            break
        seg = _target(core, obj, planned)
        if seg is None:
            continue
        copies.setdefault(seg, []).append(obj.key)
        planned[seg] = planned.get(seg, 0) + obj.size_bytes
        spent += obj.size_bytes
    return Plan(copies, len(under), more)
