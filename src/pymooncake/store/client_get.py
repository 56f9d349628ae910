"""The Store client's reads: replica plans (and leases) from the master, copies with
replica fallback, the checksum check of every copy (issue 17: a replica whose bytes fail
is dropped and the next one tried; none left: ``CHECKSUM_MISMATCH`` naming the key), the
one lease check after the copy (case BUG-15), and SSD-held keys loaded back in rounds
(case BUG-62)."""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections.abc import Callable, Sequence

import numpy as np

from pymooncake.store.checksum import copy_verified, verify_at
from pymooncake.store.client_badreplica import BadReplicaOps
from pymooncake.store.client_base import (
    GET_LATENCY,
    GET_RESULT,
    LOAD_CHUNK,
    LOCAL_DONE,
    NEEDS_LOAD,
)
from pymooncake.store.client_memory import check_lists
from pymooncake.store.client_overlap import note_place, planned_get
from pymooncake.store.datapath import Move
from pymooncake.store.errors import ErrorCode, StoreError
from pymooncake.store.protocol import (
    TIER_DRAM,
    KeyRequest,
    KeysRequest,
    ReadAnswer,
    ReplicaDesc,
    ReplicaList,
)


class _ReadPlan:
    __slots__ = ("key", "size", "replicas", "lease_expiry", "error", "checksum", "corrupt",
                 "generation", "bad")

    def __init__(self, key: str) -> None:
        self.key = key
        self.size = 0
        self.replicas: list[ReplicaDesc] = []
        self.lease_expiry = 0.0
        self.error: StoreError | None = None
        self.checksum: bytes | None = None  # the object's per-chunk digests (issue 17)
        self.corrupt: list[str] = []  # segments whose replica failed its checksum
        self.generation = 0
        self.bad: list[ReplicaDesc] = []  # those replicas, to report (client_badreplica)

    def bad_copy(self, rep: ReplicaDesc) -> None:
        """``rep``'s bytes failed the checksum: that replica is not tried again here, and
        when no replica is left the read fails ``CHECKSUM_MISMATCH`` (issue 17)."""
        self.corrupt.append(rep.segment)
        self.bad.append(rep)
        self.replicas = [x for x in self.replicas if x.replica_id != rep.replica_id]
        if not self.replicas:
            self.error = self.no_replica_error("checksum mismatch")

    def no_replica_error(self, reason: str) -> StoreError:
        """Every replica failed: ``CHECKSUM_MISMATCH`` naming the key when one of them
        held corrupt bytes (or the object has no checksum), else ``OBJECT_NOT_FOUND``."""
        if self.corrupt:
            what = ("it was stored without a checksum" if self.checksum is None else
                    "the replica(s) on " + ", ".join(self.corrupt) + " failed the checksum")
            return StoreError(ErrorCode.CHECKSUM_MISMATCH,
                              f"{self.key!r}: no replica with intact bytes ({what}; last: "
                              f"{reason})")
        return StoreError(ErrorCode.OBJECT_NOT_FOUND,
                          f"{self.key!r}: every replica failed ({reason})")


class GetOps(BadReplicaOps):
    """Get methods of ``StoreClient``."""

    def _plan(self, keys: Sequence[str], prefer_local: bool, load: bool = True
              ) -> list[_ReadPlan]:
        """Replica lists (and leases) for ``keys``. ``load=False``: a key held only on SSD
        is not loaded here but marked ``NEEDS_LOAD`` (``batch_get`` loads it in a later
        round, after the DRAM-resident keys were read and gave their leases back)."""
        plans = [_ReadPlan(k) for k in keys]
        ask = []
        for p in plans:
            try:
                self._check_key(p.key)
                ask.append(p)
            except StoreError as e:
                p.error = e
        if not ask:
            return plans
        t_query = self._clock()
        res = self._master("batch_get_replica_list",
                           KeysRequest(self.client_id, tuple(p.key for p in ask)),
                           list[ReadAnswer])
        answers = [self._batch_item(item) for item in res]
        queried = [t_query] * len(ask)  # when each lease was asked for (client clock)
        load_ix = [i for i, r in enumerate(answers) if isinstance(r, ReplicaList) and r.promote]
        if load_ix and not load:
            for i in load_ix:
                answers[i] = NEEDS_LOAD
            load_ix = []
        if load_ix:  # held only on SSD: the master loads them back into DRAM first
            res = self._master("load_replica_list", KeysRequest(
                self.client_id, tuple(ask[i].key for i in load_ix)), list[ReadAnswer])
            loaded = []
            for i, item in zip(load_ix, res, strict=True):
                answers[i] = self._batch_item(item)
                if not isinstance(answers[i], StoreError):
                    loaded.append(i)
            if loaded:  # a load may wait for room: ask again for a lease that starts now
                t_again = self._clock()
                res = self._master("batch_get_replica_list", KeysRequest(
                    self.client_id, tuple(ask[i].key for i in loaded)), list[ReadAnswer])
                for i, item in zip(loaded, res, strict=True):
                    r = self._batch_item(item)
                    if isinstance(r, ReplicaList) and r.promote:
                        r = StoreError(ErrorCode.NO_AVAILABLE_HANDLE,  # retryable
                                       f"{ask[i].key!r} left DRAM again before it was read")
                    answers[i] = r
                    queried[i] = t_again
        now = self._clock()
        for p, r, t_asked in zip(ask, answers, queried, strict=True):
            if isinstance(r, StoreError):
                p.error = r
            else:
                self._fill(p, r, t_asked, now, prefer_local)
        return plans

    def _fill(self, p: _ReadPlan, rl: ReplicaList, t_asked: float, now: float,
              prefer_local: bool, one: bool = False) -> None:
        """``p`` from the master's answer ``r`` (asked at ``t_asked``, client clock): size,
        lease expiry and the DRAM replicas to try, in order. The place of a key held only
        in other segments is remembered (client_overlap); ``one`` (a one-key ``get``, the
        only reader of those places): a replica in the own segment too, with the checksum."""
        p.size = rl.size_bytes
        p.checksum = rl.checksum
        p.generation = rl.generation
        p.lease_expiry = (t_asked + rl.lease_ttl_ms / 1000.0 if rl.lease_ttl_ms > 0
                          else float("inf"))
        reps = [x for x in rl.replicas if x.tier == TIER_DRAM
                and (not self._bad or self._bad.get(x.segment, 0.0) <= now)]
        if len(reps) > 1:
            self._rng.shuffle(reps)
            if prefer_local:
                reps.sort(key=lambda x: x.segment != self.segment_name)
        p.replicas = reps
        if not reps:
            p.error = StoreError(ErrorCode.OBJECT_NOT_FOUND, f"{p.key!r}: no reachable replica")
        else:  # read while the master answers, next time
            note_place(self._locations, self.segment_name, p.key, reps, rl.size_bytes,
                       rl.generation, rl.checksum, one)

    def _plan_one(self, key: str) -> _ReadPlan:
        """``_plan([key], True, load=False)`` in one ``get_replica_list`` call (no batch
        wrapping on either side): the single-key hot path of ``get``."""
        p = _ReadPlan(key)
        try:
            self._check_key(key)
            t_query = self._clock()
            r = self._master("get_replica_list", KeyRequest(self.client_id, key), ReplicaList)
        except StoreError as e:
            p.error = e
            return p
        if r.promote:
            p.error = NEEDS_LOAD
            return p
        self._fill(p, r, t_query, self._clock(), True, one=True)
        return p

    def _read(self, plans: list[_ReadPlan], dests: list[tuple[int, int] | None]) -> None:
        """Copy each planned object into ``dests[i] = (addr, capacity)``; replica fallback;
        sets ``plan.error`` on failure."""
        self._started_dp("get")
        pending = [i for i, p in enumerate(plans) if p.error is None]
        for i in pending:
            d = dests[i]
            if d is None or d[1] < plans[i].size:
                plans[i].error = StoreError(
                    ErrorCode.INVALID_PARAMS,
                    f"{plans[i].key!r}: buffer of {0 if d is None else d[1]} bytes < "
                    f"object of {plans[i].size}")
        pending = [i for i in pending if plans[i].error is None]
        left, copies, copied = [], [], []
        for i in pending:  # a replica in our own segment: one memmove, no engine round
            p = plans[i]
            rep = p.replicas[0]
            if rep.segment == self.segment_name and self._local_view(rep.addr, p.size) \
                    is not None:
                copies.append((dests[i][0], rep.addr, p.size))  # type: ignore[index]
                copied.append(i)
            else:
                left.append(i)
        if copies:
            self._copy_into(copies)
        for i in copied:  # verified after the copy; a corrupt one falls over (issue 17)
            p = plans[i]
            if verify_at(dests[i][0], p.size, p.checksum):  # type: ignore[index]
                p.replicas.pop(0)
                continue
            p.bad_copy(p.replicas[0])
            if p.error is None:
                left.append(i)
        pending = left
        while pending:
            moves = []
            for i in pending:
                rep = plans[i].replicas[0]
                moves.append(Move(False, dests[i][0], rep.segment, rep.addr, plans[i].size))
            results = self._dp.run(moves)
            nxt = []
            for i, r in zip(pending, results, strict=True):
                p = plans[i]
                rep = p.replicas[0]
                if r.ok:
                    if verify_at(dests[i][0], p.size, p.checksum):  # type: ignore[index]
                        continue
                    p.bad_copy(rep)  # corrupt bytes: the next replica, or an error
                    if p.error is None:
                        nxt.append(i)
                    continue
                p.replicas.pop(0)
                if r.peer_down:
                    self._bad[rep.segment] = self._clock() + self._bad_ttl
                    p.replicas = [x for x in p.replicas if x.segment != rep.segment]
                if p.replicas:
                    nxt.append(i)
                else:
                    p.error = p.no_replica_error(r.reason)
            pending = nxt
        for p in plans:
            self._finish_read(p)

    @staticmethod
    def _copy_into(copies: list[tuple[int, int, int]]) -> None:
        """Own-segment reads into registered memory: ``(dest, src, length)`` memmoves."""
        for dst, src, n in copies:
            ctypes.memmove(dst, src, n)

    @staticmethod
    def _copy_out(views: list[np.ndarray], checksums: list[bytes | None]
                  ) -> list[bytes | None]:
        """Local-replica reads of one batch: each copied out of this client's segment and
        checked against its object's checksum as it lands (``checksum.copy_verified``):
        None for a copy that fails it (issue 17)."""
        return [copy_verified(v.ctypes.data, v.nbytes, c)
                for v, c in zip(views, checksums, strict=True)]

    def _finish_read(self, p: _ReadPlan) -> None:
        """The one lease check of every read path, after the copy (case BUG-15); replicas
        whose copy failed the checksum are reported to the master (issue 17)."""
        if p.bad:
            self._report_bad(p)
        if p.error is LOCAL_DONE or p.error is NEEDS_LOAD:
            return  # checked by the caller once the local copy (or the load) is done
        if p.error is None and self._clock() >= p.lease_expiry:
            p.error = StoreError(ErrorCode.LEASE_EXPIRED,
                                 f"{p.key!r}: read lease lapsed before the copy completed")
        result = "hit" if p.error is None else (
            "miss" if p.error.code == ErrorCode.OBJECT_NOT_FOUND else "error")
        GET_RESULT[result].inc()

    def get(self, key: str) -> bytes:
        """The value of ``key``. Raises ``StoreError`` (``OBJECT_NOT_FOUND``,
        ``REPLICA_IS_NOT_READY``, ``LEASE_EXPIRED``, ...)."""
        t0 = time.perf_counter()
        p = planned_get(self, key, _ReadPlan)  # the master's answer, or the value read
        if not isinstance(p, _ReadPlan):  # while the master answered, confirmed by it
            GET_LATENCY.observe(time.perf_counter() - t0)
            if isinstance(p, StoreError):
                raise p
            return p
        if p.error is NEEDS_LOAD:  # held only on SSD: the batch path loads it back
            (v,) = self.batch_get([key])
        else:
            (v,) = self._serve([p])
            GET_LATENCY.observe(time.perf_counter() - t0)
        if isinstance(v, StoreError):
            raise v
        return v

    def batch_get(self, keys: Sequence[str], prefer_local: bool = True
                  ) -> list[bytes | StoreError]:
        """One value or ``StoreError`` per key. Keys held only on SSD are loaded back into
        DRAM by the master; when they do not all fit at once (a batch larger than the
        memory tier), the keys already read give their leases back and the rest are read
        in further rounds while each round makes progress, instead of the whole batch
        waiting out its RPC timeout (case BUG-62)."""
        t0 = time.perf_counter()
        keys = list(keys)
        out = self._batch_get_round(keys, prefer_local, load=False)
        todo = [i for i, v in enumerate(out) if v is NEEDS_LOAD]
        done = [keys[i] for i, v in enumerate(out) if not isinstance(v, StoreError)]
        while todo:
            if done:  # read and copied: give the leases back so eviction may reuse the DRAM
                with contextlib.suppress(StoreError):
                    self.release_leases(done)
            chunk, todo = todo[:LOAD_CHUNK], todo[LOAD_CHUNK:]
            res = self._batch_get_round([keys[i] for i in chunk], prefer_local, load=True)
            done = []
            for i, v in zip(chunk, res, strict=True):
                out[i] = v
                if not isinstance(v, StoreError):
                    done.append(keys[i])
                elif v.code == ErrorCode.NO_AVAILABLE_HANDLE:
                    todo.append(i)  # no room yet: again after this chunk's leases are back
            if not done:  # a round without progress: the rest keep their errors
                break
        for i, v in enumerate(out):
            if v is NEEDS_LOAD:
                out[i] = StoreError(ErrorCode.NO_AVAILABLE_HANDLE,
                                    f"{keys[i]!r}: no DRAM room to load it from SSD")
        GET_LATENCY.observe(time.perf_counter() - t0)
        return out

    def _batch_get_round(self, keys: Sequence[str], prefer_local: bool, load: bool
                         ) -> list[bytes | StoreError]:
        return self._serve(self._plan(keys, prefer_local, load))

    def _serve(self, plans: list[_ReadPlan]) -> list[bytes | StoreError]:
        """The bytes of each planned read (or its error): a replica in our own segment
        by one memcpy out of it, any other by the Transfer Engine into staging."""
        if len(plans) == 1:  # the one-key get: no dicts or staging when it is ours
            p = plans[0]
            if p.error is None and p.replicas and p.replicas[0].segment == self.segment_name:
                view = self._local_view(p.replicas[0].addr, p.size)
                if view is not None:  # verified while copied (issue 17)
                    (value,) = self._copy_out([view], [p.checksum])
                    if value is not None:
                        self._finish_read(p)
                        return [p.error if p.error is not None else value]
                    p.bad_copy(p.replicas[0])  # corrupt: the other replicas, or an error
                    if p.error is not None:
                        self._finish_read(p)
                        return [p.error]
            if p.error is None and p.size:  # another segment's: staged, then one copy out
                addr, arr, release = self._stage(p.size)
                try:
                    self._read(plans, [(addr, p.size)])
                    return [p.error if p.error is not None else arr.tobytes()]
                finally:
                    release()
        views: dict[int, np.ndarray] = {}
        for i, p in enumerate(plans):  # a replica in our own segment: one memcpy out
            if p.error is None and p.replicas and p.replicas[0].segment == self.segment_name:
                view = self._local_view(p.replicas[0].addr, p.size)
                if view is not None:
                    views[i] = view
                    p.error = LOCAL_DONE
        local = dict(zip(views, self._copy_out(list(views.values()),
                                               [plans[i].checksum for i in views]),
                         strict=True)) if views else {}
        for i in list(local):  # verified as copied; a corrupt one falls over
            p = plans[i]
            if local[i] is None:
                del local[i]
                p.error = None
                p.bad_copy(p.replicas[0])
        stages: list[tuple[int, np.ndarray, Callable[[], None]] | None] = []
        try:
            for p in plans:
                stages.append(self._stage(p.size) if p.error is None and p.size else None)
            self._read(plans, [(s[0], s[1].nbytes) if s else None for s in stages])
            out: list[bytes | StoreError] = []
            for i, (p, s) in enumerate(zip(plans, stages, strict=True)):
                if i in local:
                    p.error = None
                    self._finish_read(p)
                    out.append(p.error if p.error is not None else local[i])
                else:
                    out.append(p.error if p.error is not None else s[1].tobytes())  # type: ignore
        finally:
            for s in stages:
                if s is not None:
                    s[2]()
        return out

    def get_into(self, key: str, addr: int, size: int) -> int:
        """Read ``key`` into ``[addr, addr+size)`` of a registered buffer; bytes read."""
        (v,) = self.batch_get_into([key], [addr], [size])
        if isinstance(v, StoreError):
            raise v
        return v

    def batch_get_into(self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int],
                       prefer_local: bool = True) -> list[int | StoreError]:
        check_lists(keys, addrs, sizes)
        plans = self._plan(keys, prefer_local)
        dests: list[tuple[int, int] | None] = []
        for p, a, s in zip(plans, addrs, sizes, strict=True):
            if p.error is None:
                try:  # the object's bytes must land inside one registered buffer
                    self._check_range(a, min(s, p.size) if isinstance(s, int) else s, 0)
                except StoreError as e:
                    p.error = e
            dests.append((a, s) if p.error is None else None)
        self._read(plans, dests)
        return [p.error if p.error is not None else p.size for p in plans]
