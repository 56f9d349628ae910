"""The Store client's reads: replica plans (and leases) from the master, copies with
replica fallback, the one lease check after the copy (case BUG-15), and SSD-held keys
loaded back in rounds (case BUG-62)."""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections.abc import Callable, Sequence

import numpy as np

from pymooncake.store.client_base import (
    GET_LATENCY,
    GET_RESULT,
    LOAD_CHUNK,
    LOCAL_DONE,
    NEEDS_LOAD,
)
from pymooncake.store.client_master import MasterOps
from pymooncake.store.client_memory import MemoryOps, check_lists
from pymooncake.store.datapath import Move
from pymooncake.store.errors import ErrorCode, StoreError
from pymooncake.store.protocol import (
    TIER_DRAM,
    KeysRequest,
    ReplicaDesc,
    replica_list_from_wire,
)


class _ReadPlan:
    __slots__ = ("key", "size", "replicas", "lease_expiry", "error")

    def __init__(self, key: str) -> None:
        self.key = key
        self.size = 0
        self.replicas: list[ReplicaDesc] = []
        self.lease_expiry = 0.0
        self.error: StoreError | None = None


class GetOps(MasterOps, MemoryOps):
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
                           {"client_id": self.client_id, "keys": [p.key for p in ask]})
        answers = [self._batch_item(item) for item in res]
        queried = [t_query] * len(ask)  # when each lease was asked for (client clock)
        load_ix = [i for i, r in enumerate(answers) if isinstance(r, dict) and r.get("promote")]
        if load_ix and not load:
            for i in load_ix:
                answers[i] = NEEDS_LOAD
            load_ix = []
        if load_ix:  # held only on SSD: the master loads them back into DRAM first
            res = self._master("load_replica_list", KeysRequest(
                self.client_id, tuple(ask[i].key for i in load_ix)))
            loaded = []
            for i, item in zip(load_ix, res, strict=True):
                answers[i] = self._batch_item(item)
                if not isinstance(answers[i], StoreError):
                    loaded.append(i)
            if loaded:  # a load may wait for room: ask again for a lease that starts now
                t_again = self._clock()
                res = self._master("batch_get_replica_list", {
                    "client_id": self.client_id, "keys": [ask[i].key for i in loaded]})
                for i, item in zip(loaded, res, strict=True):
                    r = self._batch_item(item)
                    if isinstance(r, dict) and r.get("promote"):
                        r = StoreError(ErrorCode.NO_AVAILABLE_HANDLE,  # retryable
                                       f"{ask[i].key!r} left DRAM again before it was read")
                    answers[i] = r
                    queried[i] = t_again
        now = self._clock()
        for p, r, t_asked in zip(ask, answers, queried, strict=True):
            if isinstance(r, StoreError):
                p.error = r
                continue
            rl = replica_list_from_wire(r)
            p.size = rl.size_bytes
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
                p.error = StoreError(ErrorCode.OBJECT_NOT_FOUND,
                                     f"{p.key!r}: no reachable replica")
        return plans

    def _read(self, plans: list[_ReadPlan], dests: list[tuple[int, int] | None]) -> None:
        """Copy each planned object into ``dests[i] = (addr, capacity)``; replica fallback;
        sets ``plan.error`` on failure."""
        assert self._dp is not None
        pending = [i for i, p in enumerate(plans) if p.error is None]
        for i in pending:
            d = dests[i]
            if d is None or d[1] < plans[i].size:
                plans[i].error = StoreError(
                    ErrorCode.INVALID_PARAMS,
                    f"{plans[i].key!r}: buffer of {0 if d is None else d[1]} bytes < "
                    f"object of {plans[i].size}")
        pending = [i for i in pending if plans[i].error is None]
        left, copies = [], []
        for i in pending:  # a replica in our own segment: one memmove, no engine round
            p = plans[i]
            rep = p.replicas[0]
            if rep.segment == self.segment_name and self._local_view(rep.addr, p.size) \
                    is not None:
                copies.append((dests[i][0], rep.addr, p.size))  # type: ignore[index]
                p.replicas.pop(0)
            else:
                left.append(i)
        if copies:
            self._copy_into(copies)
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
                rep = p.replicas.pop(0)
                if r.ok:
                    continue
                if r.peer_down:
                    self._bad[rep.segment] = self._clock() + self._bad_ttl
                    p.replicas = [x for x in p.replicas if x.segment != rep.segment]
                if p.replicas:
                    nxt.append(i)
                else:
                    p.error = StoreError(ErrorCode.OBJECT_NOT_FOUND,
                                         f"{p.key!r}: every replica failed ({r.reason})")
            pending = nxt
        for p in plans:
            self._finish_read(p)

    @staticmethod
    def _copy_into(copies: list[tuple[int, int, int]]) -> None:
        """Own-segment reads into registered memory: ``(dest, src, length)`` memmoves."""
        for dst, src, n in copies:
            ctypes.memmove(dst, src, n)

    @staticmethod
    def _copy_out(views: list[np.ndarray]) -> list[bytes]:
        """Local-replica reads of one batch: a memcpy each out of this client's segment."""
        return [v.tobytes() for v in views]

    def _finish_read(self, p: _ReadPlan) -> None:
        """The one lease check of every read path, after the copy (case BUG-15)."""
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
        (v,) = self.batch_get([key])
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
        plans = self._plan(keys, prefer_local, load)
        views: dict[int, np.ndarray] = {}
        for i, p in enumerate(plans):  # a replica in our own segment: one memcpy out
            if p.error is None and p.replicas and p.replicas[0].segment == self.segment_name:
                view = self._local_view(p.replicas[0].addr, p.size)
                if view is not None:
                    views[i] = view
                    p.error = LOCAL_DONE
        local = dict(zip(views, self._copy_out(list(views.values())), strict=True)) \
            if views else {}
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

    def get_size(self, key: str) -> int:
        plans = self._plan([key], True)
        if plans[0].error is not None:
            raise plans[0].error
        return plans[0].size
