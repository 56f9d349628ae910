"""The Store client's writes: ``put``/``batch_put`` of bytes values and
``put_from``/``batch_put_from`` of registered memory, two-phase on the master."""

from __future__ import annotations

import ctypes
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pymooncake.rpc import to_wire
from pymooncake.store.checksum import digests_begin, view_at
from pymooncake.store.client_base import DEFAULT_CONFIG, PUT_LATENCY
from pymooncake.store.client_master import MasterOps
from pymooncake.store.client_memory import MemoryOps, check_lists
from pymooncake.store.client_overlap import note_place
from pymooncake.store.config import ReplicateConfig
from pymooncake.store.datapath import Move
from pymooncake.store.errors import ErrorCode, StoreError
from pymooncake.store.protocol import (
    BatchPutEndRequest,
    BatchPutStartRequest,
    PutEndRequest,
    PutHandle,
    PutStartRequest,
    WriteAnswer,
)


@functools.lru_cache(maxsize=256)
def _config_wire(config: ReplicateConfig) -> dict[str, Any] | None:
    """The wire map of a (frozen, hashable) config; ``None`` for the default one."""
    return None if config == DEFAULT_CONFIG else to_wire(config)


class PutOps(MasterOps, MemoryOps):
    """Put methods of ``StoreClient``."""

    @staticmethod
    def _as_bytes(value: object) -> memoryview:
        if isinstance(value, bytes | bytearray | memoryview):
            mv = memoryview(value)
            return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
        if isinstance(value, np.ndarray) and value.flags.c_contiguous:
            return memoryview(value).cast("B")
        raise StoreError(ErrorCode.INVALID_PARAMS,
                         f"value must be bytes-like, got {type(value).__name__}")

    def put(self, key: str, value: bytes | bytearray | memoryview,
            config: ReplicateConfig | None = None) -> None:
        """Store ``value`` under ``key`` (two-phase). Raises ``StoreError``:
        ``OBJECT_ALREADY_EXISTS`` if present, ``NO_AVAILABLE_HANDLE`` when full,
        ``INVALID_KEY``/``INVALID_PARAMS`` for bad input (nothing stored)."""
        (err,) = self.batch_put([key], [value], config)
        if err is not None:
            raise err

    def batch_put(self, keys: Sequence[str], values: Sequence[Any],
                  config: ReplicateConfig | None = None) -> list[StoreError | None]:
        """Put many; one ``None`` (stored) or ``StoreError`` per key."""
        t0 = time.perf_counter()
        check_lists(keys, values)
        out: list[StoreError | None] = [None] * len(keys)
        views: list[memoryview | None] = []
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            try:
                self._check_key(k)
                mv = self._as_bytes(v)
                if mv.nbytes == 0:
                    raise StoreError(ErrorCode.INVALID_PARAMS, "empty value")
                views.append(mv)
            except StoreError as e:
                out[i] = e
                views.append(None)
        self._put(list(keys), views, [(v.nbytes if v is not None else 0) for v in views],
                  config, out)
        PUT_LATENCY.observe(time.perf_counter() - t0)
        return out

    def put_from(self, key: str, addr: int, size: int,
                 config: ReplicateConfig | None = None) -> None:
        """Store ``size`` bytes at ``addr`` of a registered buffer (zero copy here)."""
        (err,) = self.batch_put_from([key], [addr], [size], config)
        if err is not None:
            raise err

    def batch_put_from(self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int],
                       config: ReplicateConfig | None = None) -> list[StoreError | None]:
        check_lists(keys, addrs, sizes)
        out: list[StoreError | None] = [None] * len(keys)
        for i, (k, a, s) in enumerate(zip(keys, addrs, sizes, strict=True)):
            try:
                self._check_key(k)
                self._check_range(a, s, 1)
            except StoreError as e:
                out[i] = e
        self._put(list(keys), list(addrs),
                  [s if out[i] is None else 0 for i, s in enumerate(sizes)], config, out)
        return out

    def _put(self, keys: list[str], sources: list[Any], sizes: list[int],
             config: ReplicateConfig | None, out: list[StoreError | None]) -> None:
        """Two-phase put of ``sources[i]``: a registered address (``put_from``) or a
        bytes view (``put``). Replicas in this process's own segment are filled by one
        memcpy (as Mooncake does for local replicas); every other replica is written by the
        Transfer Engine, from a staging copy for bytes views."""
        idx = [i for i in range(len(keys)) if out[i] is None]
        if not idx:
            return
        one = len(idx) == 1  # one key: put_start/put_end, no batch wrapping on either side
        wire = (_config_wire(config) if config is not None and config is not DEFAULT_CONFIG
                else None)
        handles: dict[int, PutHandle] = {}
        if one:
            r = self._answer("put_start", PutStartRequest(
                self.client_id, keys[idx[0]], sizes[idx[0]], wire), PutHandle)
            if isinstance(r, StoreError):
                out[idx[0]] = r
                return
            handles[idx[0]] = r
        else:
            req = BatchPutStartRequest(self.client_id, tuple(keys[i] for i in idx),
                                       tuple(sizes[i] for i in idx), wire)
            for i, item in zip(idx, self._master("batch_put_start", req, list[WriteAnswer]),
                               strict=True):
                r = self._batch_item(item)
                if isinstance(r, StoreError):
                    out[i] = r
                else:
                    handles[i] = r
        moves, owners = [], []
        staged: list[Callable[[], None]] = []
        # the bytes' checksum, sent with put_end (issue 17); a large value's is hashed on
        # the checksum helper thread while this thread copies it
        pending: dict[int, Callable[[], bytes]] = {}
        try:
            for i, h in handles.items():
                src = sources[i]
                src_addr = src if isinstance(src, int) else None
                pending[i] = digests_begin(src if src_addr is None
                                           else view_at(src_addr, sizes[i]))
                for rep in h.replicas:
                    local = (self._local_view(rep.addr, sizes[i])
                             if rep.segment == self.segment_name else None)
                    if local is not None:  # our own segment: one copy, no engine round
                        if src_addr is None:
                            local[:] = np.frombuffer(src, dtype=np.uint8)
                        else:
                            ctypes.memmove(rep.addr, src_addr, sizes[i])
                        continue
                    if src_addr is None:
                        src_addr, arr, release = self._stage(sizes[i])
                        arr[:] = np.frombuffer(src, dtype=np.uint8)
                        staged.append(release)
                    moves.append(Move(True, src_addr, rep.segment, rep.addr, sizes[i]))
                    owners.append(i)
            self._started_dp("put")
            results = self._dp.run(moves)
        finally:  # every hash waited for, even on an error: it reads the caller's memory
            sums = {i: result() for i, result in pending.items()}
            for release in staged:
                release()
        failed: dict[int, str] = {}
        for i, r in zip(owners, results, strict=True):
            if not r.ok:
                failed.setdefault(i, r.reason)
        ok = [i for i in handles if i not in failed]
        if failed:
            self._master("batch_put_revoke", BatchPutEndRequest(
                self.client_id, tuple(keys[i] for i in failed),
                tuple(handles[i].generation for i in failed)))
            for i, reason in failed.items():
                out[i] = StoreError(ErrorCode.TRANSFER_FAIL, f"write of {keys[i]!r}: {reason}")
        if ok and one:
            r = self._answer("put_end", PutEndRequest(
                self.client_id, keys[ok[0]], handles[ok[0]].generation, sums[ok[0]]))
            if isinstance(r, StoreError):
                out[ok[0]] = r
        elif ok:
            res = self._master("batch_put_end", BatchPutEndRequest(
                self.client_id, tuple(keys[i] for i in ok),
                tuple(handles[i].generation for i in ok), tuple(sums[i] for i in ok)))
            for i, item in zip(ok, res, strict=True):
                r = self._batch_item(item)
                if isinstance(r, StoreError):
                    out[i] = r
        for i in ok:  # where a replica lies: a later get reads it while the master answers
            if out[i] is None:
                note_place(self._locations, self.segment_name, keys[i], handles[i].replicas,
                           sizes[i], handles[i].generation, sums[i], one)

    def _answer(self, method: str, params: Any, reply_type: Any = None) -> Any:
        """A single-key call's result, or the master's ``StoreError`` answer as a value (as
        a batch item carries it); a lost or timed-out call raises, as a batch call does."""
        try:
            return self._master(method, params, reply_type)
        except StoreError as e:
            if e.code in (ErrorCode.RPC_TIMEOUT, ErrorCode.RPC_FAIL):
                raise
            return e
