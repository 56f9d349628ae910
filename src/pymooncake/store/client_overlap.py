"""A one-key get whose master round trip overlaps the read of the bytes (issue 16).

A client remembers where objects it wrote (and read) live: ``Location`` = segment,
address, size and the object's generation, and for a replica in its own segment the
object's checksum. A ``get`` of such a key sends ``get_replica_list`` to the master, reads
the remembered range while the master answers — another process's segment into staging
by the Transfer Engine, its own segment by one copy into the new value, each 256 KiB
piece hashed as it lands (``checksum.copy_verified``) — and then takes the answer. The
bytes are kept only when the answer confirms them: the same generation (a removed and
re-put key has another one), the same size, a readable DRAM replica at the same segment
and address, and the object's checksum (the answer's, which for an own replica must
also be the remembered one) verifies every byte read. Same generation and place alone
do not prove the range was untouched — a replica loaded back from SSD keeps its
generation and may be rewritten while it is read — so the checksum is what makes a
kept read right; the lease granted with the answer and the lease check after the copy
(case BUG-15) are as on the usual path. Anything else — another place, a failed or
corrupt read, an error — falls back to the usual read with the answer already in hand
(no second master call), so a stale location costs one wasted read and never a wrong
value.

Own-segment places are remembered only by the one-key paths (``put``, ``get``) and for
objects of up to ``OWN_MAX_BYTES`` with a checksum: batch puts and reads (KV blocks) are
read back in batches, which never look here. A 16 MiB embedded get then spends the
master's round trip inside its copy instead of before it (docs/benchmarks.md, issue 16
session 42).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from pymooncake.rpc import RpcConnectionError, RpcError, RpcTimeout
from pymooncake.store.checksum import verify_at
from pymooncake.store.client_base import NEEDS_LOAD
from pymooncake.store.datapath import Move
from pymooncake.store.errors import StoreError
from pymooncake.store.protocol import KeyRequest, ReplicaDesc, ReplicaList

if TYPE_CHECKING:
    from pymooncake.store.client_get import GetOps, _ReadPlan

LOCATIONS_MAX = 4096
"""Keys whose location a client remembers (the oldest forgotten first)."""
OWN_MAX_BYTES = 64 << 20
"""Largest object whose own-segment place is remembered: its checksum (1 + 8 bytes per
64 KiB, 8 KiB at 64 MiB) is kept with it, so ``LOCATIONS_MAX`` of them stay under 32 MiB."""


def note_place(locations: dict[str, Location], own: str, key: str,
               reps: Sequence[ReplicaDesc], size: int, generation: int,
               checksum: bytes | None, one: bool) -> None:
    """After a put or a read of ``key`` (``reps``: its replicas, the one to read first
    first): remember the first one when none is in segment ``own`` (the client's); else,
    on a one-key path (``one``), the own one with ``checksum`` when there is one and the
    object is at most ``OWN_MAX_BYTES`` (a batch of KV blocks is read back in batches,
    which never look here)."""
    mine = next((r for r in reps if r.segment == own), None)
    if mine is None:
        if reps:
            remember(locations, key, Location(reps[0].segment, reps[0].addr, size,
                                              generation))
    elif one and checksum is not None and size <= OWN_MAX_BYTES:
        remember(locations, key, Location(own, mine.addr, size, generation, checksum))


class Location(NamedTuple):
    """Where ``size`` bytes of an object of ``generation`` lie: ``segment`` at ``addr``;
    ``checksum`` (the object's, ``checksum.digests`` form) is kept for a replica in the
    client's own segment, whose copy is verified as it lands."""
    segment: str
    addr: int
    size: int
    generation: int
    checksum: bytes | None = None


def remember(locations: dict[str, Location], key: str, loc: Location) -> None:
    """Remember ``key`` at ``loc`` (bounded: the oldest entry goes)."""
    locations.pop(key, None)
    locations[key] = loc
    if len(locations) > LOCATIONS_MAX:  # another thread may get there first
        with contextlib.suppress(KeyError, RuntimeError, StopIteration):
            del locations[next(iter(locations))]


def planned_get(c: GetOps, key: str, plan: type[_ReadPlan]
                ) -> bytes | StoreError | _ReadPlan:
    """A one-key get's start: the value (or ``StoreError``) read while the master answered
    when ``key``'s place is remembered and the answer confirms it, else the read plan from
    the master's answer (``GetOps._plan_one`` when nothing was asked ahead)."""
    loc = c._locations.get(key) if type(key) is str else None
    got = overlapped_get(c, key, loc, plan) if loc is not None else None
    return c._plan_one(key) if got is None else got


def overlapped_get(c: GetOps, key: str, loc: Location, plan: type[_ReadPlan]
                   ) -> bytes | StoreError | _ReadPlan | None:
    """``key``'s value (or ``StoreError``) read while the master answers; a plan (the
    master's answer) for the usual read when the remembered bytes were not confirmed;
    ``None`` when nothing was asked (no leader connection yet, or it failed: the usual
    path asks, failing over), or when ``loc`` lies on a segment known to have failed (the
    usual path skips it without a read)."""
    if c._dp is None:
        return None
    t_query = c._clock()
    if c._bad and c._bad.get(loc.segment, 0.0) > t_query:
        return None
    finish = c._rpc.begin("get_replica_list", KeyRequest(c.client_id, key))
    if finish is None:
        return None
    answer: ReplicaList | StoreError | None = None
    staged = None
    moved = False
    value = None  # a copy out of our own segment, verified against loc.checksum
    own = loc.segment == c.segment_name
    try:
        try:
            if own:
                view = c._local_view(loc.addr, loc.size)  # (note_place: with a checksum)
                if view is not None:  # as the usual own-segment read: verified as copied
                    (value,) = c._copy_out([view], [loc.checksum])
                moved = value is not None
            else:
                staged = c._stage(loc.size)
                (res,) = c._dp.run([Move(False, staged[0], loc.segment, loc.addr, loc.size)])
                moved = res.ok
                if res.peer_down:  # as the usual read: skipped by this and later reads
                    c._bad[loc.segment] = c._clock() + c._bad_ttl
        except Exception:  # noqa: BLE001 - a guess that failed: the answer decides
            moved = False
        finally:
            try:
                answer = finish(ReplicaList)
            except (RpcTimeout, RpcConnectionError):
                answer = None  # asked again by the usual path, which fails over
            except RpcError as e:
                answer = StoreError.from_rpc(e)
        if answer is None:
            return None
        p = plan(key)
        if isinstance(answer, StoreError):
            c._locations.pop(key, None)
            p.error = answer
            return p
        if answer.promote:  # held only on SSD: the batch path loads it back
            p.error = NEEDS_LOAD
            return p
        c._fill(p, answer, t_query, c._clock(), True, one=True)
        if not (p.error is None and moved and answer.generation == loc.generation
                and answer.size_bytes == loc.size
                and any(r.segment == loc.segment and r.addr == loc.addr
                        for r in p.replicas)):
            return p
        if own:  # verified as copied, against the checksum the answer must confirm
            if value is None or p.checksum != loc.checksum:
                return p
        elif staged is not None and verify_at(staged[0], loc.size, p.checksum):
            value = staged[1].tobytes()
        else:
            return p
        c._finish_read(p)  # the lease check after the copy (BUG-15), the hit count
        return p.error if p.error is not None else value
    finally:
        if staged is not None:
            staged[2]()
