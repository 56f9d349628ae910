"""Ranged reads of Store objects: plan once, read byte ranges in several rounds.

A layer-wise KV load (Mooncake FAST'25 §3.1 step 1, DESIGN.md §1) reads a block object's
layers ``[a, b)`` — one contiguous byte range of ``[layer, K/V, kv_head, block_size,
head_dim]`` — while earlier layers already compute. ``open_reads`` asks the master for
the replicas and read leases of all objects in one round trip; ``RangedRead.read`` copies
byte ranges of them into registered memory (a memmove from this client's own segment,
else Transfer Engine READs, falling back to the next replica when one fails), as many
rounds as the caller likes. Every copy is verified against the object's per-chunk
checksums (issue 17; ``store.checksum``): a range is read as the whole chunks covering it
(in place when chunk-aligned, else through a staging buffer), and a replica whose bytes
fail is dropped like a failed transfer (``CHECKSUM_MISMATCH`` when none is left).
Every round checks the leases after its copies (case BUG-15):
a range copied after its object's lease lapsed reports ``LEASE_EXPIRED`` (its bytes may
be a reused allocation's); ``close`` records the reads' results.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from pymooncake.store.checksum import chunk_span, verify_at
from pymooncake.store.client_get import GetOps
from pymooncake.store.datapath import Move
from pymooncake.store.errors import ErrorCode, StoreError


class RangedRead:
    """Objects planned by ``StoreClient.open_reads``; ``sizes[i]`` is object ``i``'s size
    in bytes, or the ``StoreError`` that made it unreadable (a miss: ``OBJECT_NOT_FOUND``).
    Used by one thread at a time."""

    def __init__(self, client: RangeGetOps, plans: list) -> None:
        self._client = client
        self._plans = plans
        self.sizes: list[int | StoreError] = [p.error if p.error is not None else p.size
                                              for p in plans]

    def read(self, ranges: Sequence[tuple[int, int, int, int]]) -> list[StoreError | None]:
        """Copy ``(object index, offset, length, dest addr)`` ranges (bytes; ``dest`` inside
        registered memory); one ``None`` (copied within the object's lease) or
        ``StoreError`` per range. A failed replica is dropped for the later rounds of this
        read too.

        Raises ``StoreError(INVALID_PARAMS)`` for a range outside its object or a
        destination outside registered memory (nothing is copied then)."""
        c = self._client
        for i, off, n, dst in ranges:
            size = self.sizes[i]
            if isinstance(size, StoreError):
                continue
            if off < 0 or n <= 0 or off + n > size:
                raise StoreError(ErrorCode.INVALID_PARAMS,
                                 f"range [{off}, +{n}) outside object {i} of {size} B")
            c._check_range(dst, n, 1)
        out: list[StoreError | None] = [None] * len(ranges)
        pending: list[int] = []
        for j, (i, _, _, _) in enumerate(ranges):
            p = self._plans[i]
            if p.error is not None:
                out[j] = p.error
            elif not p.replicas:
                out[j] = StoreError(ErrorCode.OBJECT_NOT_FOUND, f"{p.key!r}: no replica left")
            else:
                pending.append(j)
        # each range is read as the whole checksum chunks covering it, verified after the
        # copy (issue 17): in place when it is chunk-aligned, else through a staging buffer
        spans = {j: chunk_span(ranges[j][1], ranges[j][2], self.sizes[ranges[j][0]])
                 for j in pending}
        stages: dict[int, int] = {}  # range -> its chunks' address in one staging buffer
        total = 0
        for j in pending:
            a, b = spans[j]
            if (a, b) != (ranges[j][1], ranges[j][1] + ranges[j][2]):
                stages[j] = total
                total += b - a
        staging = c._stage(total) if total else None
        try:
            if staging is not None:
                stages = {j: staging[0] + o for j, o in stages.items()}
            while pending:
                pending = self._round(ranges, pending, spans, stages, out)
        finally:
            if staging is not None:
                staging[2]()
        now = c._clock()
        for j, (i, _, _, _) in enumerate(ranges):  # the lease check after the copy (BUG-15)
            p = self._plans[i]
            if out[j] is None and now >= p.lease_expiry:
                out[j] = StoreError(ErrorCode.LEASE_EXPIRED, f"{p.key!r}: read lease "
                                    "lapsed before the copy completed")
        return out

    def _round(self, ranges: Sequence[tuple[int, int, int, int]], pending: list[int],
               spans: dict[int, tuple[int, int]], stages: dict[int, int], out: list
               ) -> list[int]:
        """One round of copies from each range's object's current replica; a replica
        that fails (transfer or checksum) is dropped for its object. The ranges to retry."""
        c = self._client
        local, moves, remote = [], [], []
        for j in pending:
            i, _, _, dst = ranges[j]
            a, b = spans[j]
            buf = stages.get(j, dst)
            rep = self._plans[i].replicas[0]
            if (rep.segment == c.segment_name
                    and c._local_view(rep.addr + a, b - a) is not None):
                local.append(j)
                ctypes.memmove(buf, rep.addr + a, b - a)  # our own segment: a memmove
            else:
                moves.append(Move(False, buf, rep.segment, rep.addr + a, b - a))
                remote.append(j)
        assert c._dp is not None
        failed: dict[int, str] = {}  # object index -> why its replica failed
        down: set[int] = set()
        corrupt: set[int] = set()
        failed_ranges = []
        copied = list(local)
        for j, r in zip(remote, c._dp.run(moves) if moves else [], strict=True):
            if r.ok:
                copied.append(j)
                continue
            i = ranges[j][0]
            failed.setdefault(i, r.reason)
            if r.peer_down:
                down.add(i)
            failed_ranges.append(j)
        for j in copied:  # the checksum after the copy; a good range lands in its dest
            i, off, n, dst = ranges[j]
            a, b = spans[j]
            buf = stages.get(j, dst)
            if not verify_at(buf, b - a, self._plans[i].checksum, a):
                failed[i] = "checksum mismatch"
                corrupt.add(i)
                failed_ranges.append(j)
            elif j in stages:
                ctypes.memmove(dst, buf + off - a, n)
        for i in failed:  # drop the failed replica once per object, not per range
            p = self._plans[i]
            rep = p.replicas.pop(0)
            if i in corrupt:
                p.corrupt.append(rep.segment)
                p.bad.append(rep)  # reported by _finish_read (client_badreplica)
            if i in down:
                c._bad[rep.segment] = c._clock() + c._bad_ttl
                p.replicas = [x for x in p.replicas if x.segment != rep.segment]
        retry = []
        for j in failed_ranges:
            p = self._plans[ranges[j][0]]
            if p.replicas:
                retry.append(j)
            else:
                out[j] = p.no_replica_error(failed[ranges[j][0]])
        return retry

    def close(self) -> list[StoreError | None]:
        """Done reading: the hit/miss metrics, and one ``None`` or ``StoreError`` per object
        (``LEASE_EXPIRED`` when its lease has lapsed by now)."""
        out: list[StoreError | None] = []
        for p in self._plans:
            self._client._finish_read(p)
            out.append(p.error)
        return out


class RangeGetOps(GetOps):
    """Ranged-read methods of ``StoreClient``."""

    def open_reads(self, keys: Sequence[str], prefer_local: bool = True) -> RangedRead:
        """Replicas and read leases of ``keys`` (one master round trip; SSD-only keys are
        loaded into DRAM first). Raises ``StoreError`` when the master cannot be asked."""
        return RangedRead(self, self._plan(list(keys), prefer_local))
