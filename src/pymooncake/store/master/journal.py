"""The master's journal: object and segment changes as ordered log entries (HA, pure).

An HA leader (``store/master/ha.py``) turns every change of its ``MasterCore`` into
operations and makes them durable in order, one numbered log entry per group commit:

* ``["seg", {...}]`` a mounted segment, ``["unseg", name]`` an unmounted one;
* ``["obj", {...}]`` an object's whole record (state, replicas, pins),
  ``["del", key]`` an object gone.

A record is a complete statement of its key, so applying entries in order gives the
state; a snapshot is the same operations for the whole state at one sequence number.
``MetaIndex`` applies entries (followers keep one warm; the leader keeps one of what is
durable, for snapshots); ``restore`` builds a ``MasterCore`` from it when a follower is
promoted. What is written is what the leader *did*: a put is journaled PROCESSING at
``put_start`` (its ranges are taken) and COMPLETE only at ``put_end``, which the writer
sends after its bytes landed, so metadata never becomes durable before the data it
names (case BUG-61).

Bad input never drops the index (case BUG-58): an entry that does not decode, or an
operation that is malformed, is skipped and reported (``MetaIndex.skipped``); on restore
an object whose ranges fall outside its segment or overlap another object's is dropped
— every object of an overlap, since either's bytes may be the other's — and reported
(``RestoreReport.dropped``) so the new leader journals the decision. A missing entry (a
gap) is never skipped: ``MetaIndex.apply`` raises ``LogGap``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from pymooncake.store.master.allocator import Segment
from pymooncake.store.master.core import MasterCore, _Client, _Discarded
from pymooncake.store.master.objects import ObjectMeta, ObjectState, Replica
from pymooncake.store.protocol import TIER_DRAM, TIER_SSD

SCHEMA = 1
"""Version of the entry format (``{"v": 1, "seq": n, "ops": [...]}``)."""

SKIP_UNDECODABLE = "undecodable"
SKIP_MALFORMED = "malformed"
DROP_OVERLAP = "overlap"
DROP_BAD_RANGE = "bad_range"
DROP_NO_SEGMENT = "no_segment"
RESTORE_HOLDER = "__restored__"
"""Holder of the read lease every restored object gets at promotion."""


class LogGap(Exception):
    """The next entry to apply is missing (the log has a hole, or is not there yet)."""


# -- records -------------------------------------------------------------------------------

def segment_record(seg: Segment) -> dict[str, Any]:
    return {"name": seg.name, "client": seg.client_id, "host": seg.host,
            "base": seg.base_addr, "size": seg.size_bytes, "ssd": seg.ssd_capacity_bytes,
            "rpc_host": seg.rpc_host, "rpc_port": seg.rpc_port, "holder": seg.holder}


def object_record(obj: ObjectMeta) -> dict[str, Any]:
    return {"key": obj.key, "size": obj.size_bytes, "gen": obj.generation,
            "writer": obj.writer, "complete": obj.complete,
            "replicas": [[r.replica_id, r.segment, r.addr, r.length, r.tier, r.host,
                          r.complete] for r in obj.replicas],
            "hard": obj.pin.hard, "soft_ttl_ms": obj.soft_pin_ttl_ms, "sum": obj.checksum,
            "want": obj.replica_target}


def take_changes(core: MasterCore) -> list[list[Any]]:
    """The operations for every change ``core`` recorded since the last call (mounts
    first, then objects, then unmounts), and forget them. Tracking must be on
    (``core.objects.changed`` and ``core.segments_changed`` are sets)."""
    segs, keys = core.segments_changed, core.objects.changed
    if not segs and not keys:
        return []
    ops: list[list[Any]] = []
    gone: list[str] = []
    for name in sorted(segs or ()):
        seg = core.pool.segments.get(name)
        if seg is not None:
            ops.append(["seg", segment_record(seg)])
        else:
            gone.append(name)
    for key in sorted(keys or ()):
        obj = core.objects.get(key)
        ops.append(["obj", object_record(obj)] if obj is not None else ["del", key])
    ops.extend(["unseg", name] for name in gone)
    if segs:
        segs.clear()
    if keys:
        keys.clear()
    return ops


def encode_entry(seq: int, ops: list[list[Any]]) -> bytes:
    """One log entry's bytes."""
    return msgpack.packb({"v": SCHEMA, "seq": seq, "ops": ops}, use_bin_type=True)


def _check_segment(rec: Any) -> dict[str, Any]:
    if not isinstance(rec, dict):
        raise ValueError("segment record is not a map")
    for f, t in (("name", str), ("client", str), ("host", str), ("base", int),
                 ("size", int), ("ssd", int), ("rpc_host", str), ("rpc_port", int)):
        if not isinstance(rec.get(f), t) or isinstance(rec.get(f), bool):
            raise ValueError(f"segment field {f!r} missing or not {t.__name__}")
    if not isinstance(rec.get("holder", ""), str):
        raise ValueError("segment field 'holder' not str")
    if not rec["name"] or rec["size"] <= 0 or rec["base"] < 0 or rec["ssd"] < 0:
        raise ValueError(f"segment {rec['name']!r}: bad name, size or base")
    return rec


def _check_object(rec: Any) -> dict[str, Any]:
    if not isinstance(rec, dict):
        raise ValueError("object record is not a map")
    for f, t in (("key", str), ("size", int), ("gen", int), ("writer", str),
                 ("complete", bool), ("replicas", list), ("hard", bool)):
        if not isinstance(rec.get(f), t):
            raise ValueError(f"object field {f!r} missing or not {t.__name__}")
    if not rec["key"] or rec["size"] <= 0 or rec["gen"] <= 0:
        raise ValueError(f"object {rec['key']!r}: bad key, size or generation")
    if not isinstance(rec.get("sum"), bytes | None):
        raise ValueError(f"object {rec['key']!r}: checksum is not bytes")
    want = rec.get("want", 0)  # absent in records of older masters
    if isinstance(want, bool) or not isinstance(want, int) or want < 0:
        raise ValueError(f"object {rec['key']!r}: bad replica target 'want'")
    soft = rec.get("soft_ttl_ms")
    if soft is not None and (not isinstance(soft, int | float) or soft < 0):
        raise ValueError(f"object {rec['key']!r}: bad soft_ttl_ms")
    for r in rec["replicas"]:
        if not (isinstance(r, list) and len(r) == 7 and isinstance(r[0], int)
                and isinstance(r[1], str) and isinstance(r[2], int) and isinstance(r[3], int)
                and r[4] in (TIER_DRAM, TIER_SSD) and isinstance(r[5], str)
                and isinstance(r[6], bool)):
            raise ValueError(f"object {rec['key']!r}: malformed replica {r!r}")
    return rec


# -- the replicated index ------------------------------------------------------------------

@dataclass(slots=True)
class MetaIndex:
    """The journal applied in order: segments and object records by name/key.

    ``applied_seq`` is the last entry applied; ``skipped`` lists ``(seq, reason, detail)``
    of every entry or operation that could not be used.
    """

    segments: dict[str, dict[str, Any]] = field(default_factory=dict)
    objects: dict[str, dict[str, Any]] = field(default_factory=dict)
    applied_seq: int = 0
    skipped: list[tuple[int, str, str]] = field(default_factory=list)

    def apply(self, seq: int, raw: bytes | None) -> None:
        """Apply entry ``seq`` (its stored bytes). Raises ``LogGap`` when ``seq`` is not
        ``applied_seq + 1`` or ``raw`` is ``None`` (missing). An entry that does not
        decode or is not a well-formed entry for ``seq`` is skipped and reported; so is
        each malformed operation inside a good entry."""
        if seq != self.applied_seq + 1 or raw is None:
            raise LogGap(f"entry {seq} cannot follow applied entry {self.applied_seq}"
                         + (" (missing)" if raw is None else ""))
        self.applied_seq = seq
        try:
            entry = msgpack.unpackb(raw, raw=False)
            if not (isinstance(entry, dict) and entry.get("v") == SCHEMA
                    and entry.get("seq") == seq and isinstance(entry.get("ops"), list)):
                raise ValueError("not a version-1 journal entry for this sequence number")
        except Exception as e:  # noqa: BLE001 - any decode failure is one bad record
            self.skipped.append((seq, SKIP_UNDECODABLE, str(e)[:200]))
            return
        self.apply_ops(seq, entry["ops"])

    def apply_ops(self, seq: int, ops: Iterable[Any]) -> None:
        """Apply operations (of entry ``seq``); malformed ones are skipped and reported."""
        for op in ops:
            try:
                if not isinstance(op, list) or len(op) != 2:
                    raise ValueError(f"operation {op!r:.80} is not [kind, body]")
                kind, body = op
                if kind == "obj":
                    rec = _check_object(body)
                    self.objects[rec["key"]] = rec
                elif kind == "del":
                    if not isinstance(body, str):
                        raise ValueError("del of a non-str key")
                    self.objects.pop(body, None)
                elif kind == "seg":
                    rec = _check_segment(body)
                    self.segments[rec["name"]] = rec
                elif kind == "unseg":
                    if not isinstance(body, str):
                        raise ValueError("unseg of a non-str name")
                    self.segments.pop(body, None)
                else:
                    raise ValueError(f"unknown operation {kind!r:.40}")
            except ValueError as e:
                self.skipped.append((seq, SKIP_MALFORMED, str(e)[:200]))

    def load_snapshot(self, seq: int, chunks: Iterable[bytes]) -> None:
        """Replace the state with snapshot ``seq`` (its chunk values in order); a chunk
        that does not decode is skipped and reported, the others load."""
        self.segments, self.objects = {}, {}
        for raw in chunks:
            try:
                body = msgpack.unpackb(raw, raw=False)
                if not (isinstance(body, dict) and body.get("v") == SCHEMA
                        and isinstance(body.get("ops"), list)):
                    raise ValueError("not a version-1 snapshot chunk")
            except Exception as e:  # noqa: BLE001 - one bad chunk, not the whole snapshot
                self.skipped.append((seq, SKIP_UNDECODABLE, f"snapshot chunk: {e}"[:200]))
                continue
            self.apply_ops(seq, body["ops"])
        self.applied_seq = seq

    def snapshot_chunks(self, max_chunk_bytes: int = 256 << 10) -> list[bytes]:
        """The whole state as snapshot chunks of at most about ``max_chunk_bytes``."""
        ops: list[list[Any]] = [["seg", r] for r in self.segments.values()]
        ops += [["obj", r] for r in self.objects.values()]
        chunks: list[bytes] = []
        cur: list[bytes] = []
        size = 0
        for op in ops:
            b = msgpack.packb(op, use_bin_type=True)
            if cur and size + len(b) > max_chunk_bytes:
                chunks.append(_chunk(cur))
                cur, size = [], 0
            cur.append(b)
            size += len(b)
        if cur or not chunks:
            chunks.append(_chunk(cur))
        return chunks


def _chunk(packed_ops: list[bytes]) -> bytes:
    ops = [msgpack.unpackb(b, raw=False) for b in packed_ops]
    return msgpack.packb({"v": SCHEMA, "ops": ops}, use_bin_type=True)


# -- restore -------------------------------------------------------------------------------

@dataclass(slots=True)
class RestoreReport:
    """What a promotion loaded: counts, and the objects it refused (``(key, reason)``)."""

    objects: int = 0
    segments: int = 0
    discarded_writes: list[str] = field(default_factory=list)
    dropped: list[tuple[str, str]] = field(default_factory=list)


def restore(index: MetaIndex, core: MasterCore, now_ms: float) -> RestoreReport:
    """Load ``index`` into an empty ``core`` at ``now_ms``.

    Segments are mounted and their clients known (last seen one ``client_ttl`` from now,
    so each has two to find and heartbeat the new leader: its calls to a frozen old
    leader may still be timing out). Published objects become readable with
    their ranges reserved at the same offsets, LRU recency and soft pins starting now,
    and a fresh read lease (``default_kv_lease_ttl``): reads that began under the old
    leader hold leases this core never saw, so no restored object is evicted or removed
    (unless forced) before they are over.
    Unfinished writes are not restored (their ``put_end`` answers a retryable
    ``UNAVAILABLE_IN_CURRENT_STATUS``): their ranges stay taken until
    ``put_start_release_timeout_s`` from now, since their writers may still be sending.
    Objects whose ranges are outside their segment, on an unknown segment, or overlap
    another object's are dropped and reported; only the conflicting records go.
    """
    rep = RestoreReport()
    for rec in index.segments.values():
        core.pool.mount(Segment(rec["name"], rec["client"], rec["host"], rec["base"],
                                rec["size"], rec["ssd"], rec["rpc_host"], rec["rpc_port"],
                                rec.get("holder", "")))
        c = core.clients.get(rec["client"])
        if c is None:
            # seen "one TTL from now": a client may still be timing out on the old leader
            # before it finds this one; a holder lost with it is dropped one TTL later
            c = core.clients[rec["client"]] = _Client(
                rec["client"], now_ms + core.config.client_ttl_s * 1000.0)
        c.segments.add(rec["name"])
        rep.segments += 1
    bad: dict[str, str] = {}
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for key, rec in index.objects.items():
        for _rid, seg_name, addr, length, tier, _host, _ok in rec["replicas"]:
            seg = core.pool.segments.get(seg_name)
            if seg is None:
                bad.setdefault(key, DROP_NO_SEGMENT)
                continue
            if tier != TIER_DRAM:
                continue
            off = addr - seg.base_addr
            if length != rec["size"] or off < 0 or off % seg.allocator.alignment \
                    or off + length > seg.allocator.capacity_bytes:
                bad.setdefault(key, DROP_BAD_RANGE)
                continue
            spans.setdefault(seg_name, []).append((off, off + length, key))
    for ivs in spans.values():
        ivs.sort()
        group = [ivs[0]]
        end = ivs[0][1]
        for iv in ivs[1:] + [(1 << 62, 1 << 62, "")]:
            if iv[0] < end:
                group.append(iv)
                end = max(end, iv[1])
                continue
            if len(group) > 1:
                for _, _, k in group:
                    bad[k] = DROP_OVERLAP
            group, end = [iv], iv[1]
    max_gen = max_rid = 0
    for key, rec in sorted(index.objects.items()):
        max_gen = max(max_gen, rec["gen"])
        max_rid = max([max_rid] + [r[0] for r in rec["replicas"]])
        if key in bad:
            rep.dropped.append((key, bad[key]))
            continue
        held: list[tuple[str, int]] = []
        replicas: list[Replica] = []
        for rid, seg_name, addr, length, tier, host, ok in rec["replicas"]:
            seg = core.pool.segments[seg_name]
            if tier == TIER_DRAM:
                if not seg.allocator.reserve(addr - seg.base_addr, length):
                    bad[key] = DROP_OVERLAP  # cannot happen after the sweep; stay safe
                    break
                held.append((seg_name, addr))
            if rec["complete"] and (ok or tier == TIER_SSD):
                replicas.append(Replica(rid, seg_name, addr, length, tier, host, True))
        if key in bad:
            for seg_name, addr in held:
                core.pool.free(seg_name, addr)
            rep.dropped.append((key, bad[key]))
            continue
        release_ms = now_ms + core.config.put_start_release_timeout_s * 1000.0
        if not rec["complete"] or not replicas:
            core._discarded.append(_Discarded(held, release_ms))
            rep.discarded_writes.append(key)
            continue
        dram_kept = {(r.segment, r.addr) for r in replicas if r.tier == TIER_DRAM}
        loading = [h for h in held if h not in dram_kept]  # a load from SSD in flight
        if loading:
            core._discarded.append(_Discarded(loading, release_ms))
        obj = ObjectMeta(key, rec["size"], rec["gen"], rec["writer"], now_ms,
                         replicas=replicas, state=ObjectState.COMPLETE,
                         soft_pin_ttl_ms=rec.get("soft_ttl_ms"), last_access_ms=now_ms,
                         checksum=rec.get("sum"))
        obj.replica_target = rec.get("want") or obj.replica_count()
        obj.pin.hard = rec["hard"]
        if obj.soft_pin_ttl_ms is not None:
            obj.pin.soft_deadline_ms = now_ms + obj.soft_pin_ttl_ms
        for r in replicas:
            if r.tier == TIER_SSD:
                core.ssd_used[r.segment] += r.length
        core.objects.put(obj)
        # a fresh read lease: a reader still copying under the old leader's lease is
        # never overwritten by an eviction here (BUG-58; one default lease TTL)
        core.leases.grant(key, RESTORE_HOLDER, now_ms, core.config.default_kv_lease_ttl_ms)
        rep.objects += 1
    core._generation = max(core._generation, max_gen)
    core.generation_floor = max_gen + 1
    core._replica_id = max(core._replica_id, max_rid)
    core.replicas_lost = True  # the new leader checks every object's replicas once
    return rep
