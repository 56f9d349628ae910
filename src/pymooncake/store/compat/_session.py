"""Put/get sessions of ``MooncakeDistributedStore`` (Mooncake's ``RealClient``
``batch_{put,get}_session_*`` and the ranged multi-buffer transfers), on pymooncake's
two-phase put and ranged reads.

A **get session** asks the master once for each object's replicas and read lease
(``StoreClient.open_reads``) and keeps them; ``batch_get_into_multi_buffer_ranges`` then
copies byte ranges of the objects into registered memory without asking the master again
(a layer-wise KV load: Mooncake FAST'25 §3.1 step 1), until ``batch_get_session_end``. A
range copied after the lease lapsed answers ``LEASE_EXPIRED`` (-707) and ends the key's
session, as Mooncake.

A **put session** reserves each object on the master (``put_start``: replicas allocated,
the object invisible to readers); ``batch_put_from_multi_buffer_ranges`` writes byte
ranges into every replica; ``batch_put_session_end`` publishes the objects (``put_end``),
``batch_put_session_revoke`` frees them (``put_revoke``). pymooncake keeps a local copy of
each reserved object, so bytes never written are zeros (written at end) and the object's
checksum (issue 17) is computed at end from the bytes written.

Return codes and argument checks follow Mooncake's ``real_client.cpp`` (commit 3b5a594):
a key without a session, ranges whose list lengths disagree, or a range outside the
object answer -600; per key the bytes transferred (the sum of its ranges); before
``setup`` the per-key forms answer ``[]`` and ``batch_get_session_end`` -1 (pybind
wrapper). Arguments of the wrong type raise ``TypeError``, as pybind11's conversions do.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pymooncake.store.compat._codes import INVALID_PARAMS as _INVALID_PARAMS
from pymooncake.store.compat._codes import OK as _OK
from pymooncake.store.compat._codes import code as _code
from pymooncake.store.datapath import Move
from pymooncake.store.errors import ErrorCode, StoreError

try:  # per-chunk checksums sent with put_end (issue 17), where this tree has them
    from pymooncake.store.checksum import digests as _digests
except ImportError:  # pragma: no cover - a tree without store.checksum
    _digests = None

_TRANSFER_FAIL = int(ErrorCode.TRANSFER_FAIL)
_LEASE_EXPIRED = int(ErrorCode.LEASE_EXPIRED)
_INVALID_REPLICA = int(ErrorCode.INVALID_REPLICA)


def str_list(value: Any, name: str) -> list[str]:
    """``value`` as pybind's ``std::vector<std::string>``: a list/tuple of str, else
    ``TypeError``."""
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a list of str, got {type(value).__name__}")
    if not all(isinstance(v, str) for v in value):
        raise TypeError(f"{name} must be a list of str")
    return list(value)


def _uint(v: Any, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 0:
        raise TypeError(f"{name}: expected an unsigned int, got {v!r}")
    return int(v)


def uint_list(value: Any, name: str) -> list[int]:
    """``std::vector<size_t>``: non-negative ints, else ``TypeError``."""
    if isinstance(value, str | bytes) or not isinstance(value, Sequence | np.ndarray):
        raise TypeError(f"{name} must be a list of int, got {type(value).__name__}")
    return [_uint(v, name) for v in value]


def uint_lists(value: Any, name: str) -> list[list[int]]:
    """``std::vector<std::vector<size_t>>`` (or of ``uintptr_t``)."""
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a list of lists of int")
    return [uint_list(v, name) for v in value]


def _overflow(off: int, n: int, limit: int) -> bool:
    return n > limit or off > limit - n


@dataclass
class _GetSession:
    reads: Any  # the RangedRead of the start call that planned this key
    index: int
    size: int


@dataclass
class _PutSession:
    handle: Any  # PutHandle
    shadow: np.ndarray  # the object's bytes as written so far (zeros elsewhere)
    written: list[tuple[int, int]] = field(default_factory=list)
    writable: bool = True
    inflight: int = 0


class SessionMethods:
    """Mixed into ``MooncakeDistributedStore``."""

    _client: Any
    _registered: Any
    _cfg: Any

    def _init_sessions(self) -> None:
        self._get_sessions: dict[str, _GetSession] = {}
        self._put_sessions: dict[str, _PutSession] = {}
        self._session_cv = threading.Condition()

    # -- get sessions ------------------------------------------------------------------

    def _drop_get(self, key: str, keep: Any = None) -> None:
        """Forget ``key``'s get session; close its RangedRead when no key uses it (unless
        it is ``keep``, the one a start call is filling)."""
        s = self._get_sessions.pop(key, None)
        if s is not None and s.reads is not keep and not any(
                o.reads is s.reads for o in self._get_sessions.values()):
            s.reads.close()

    def batch_get_session_start(self, keys: Sequence[str]) -> list[int]:
        """Query each key's replicas and lease once and keep them: 0 per key, -704 when
        missing, another code when the master cannot answer."""
        keys = str_list(keys, "keys")
        if self._client is None:
            return []
        if not keys:
            return []
        try:
            reads = self._client.open_reads(keys)
        except Exception as e:  # noqa: BLE001
            return [_code(e)] * len(keys)
        out = []
        with self._session_cv:
            for i, (k, size) in enumerate(zip(keys, reads.sizes, strict=True)):
                self._drop_get(k, keep=reads)
                if isinstance(size, StoreError):
                    out.append(_code(size))
                    continue
                self._get_sessions[k] = _GetSession(reads, i, int(size))
                out.append(_OK)
            if not any(s.reads is reads for s in self._get_sessions.values()):
                reads.close()
        return out

    def batch_get_into_multi_buffer_ranges(self, keys: Sequence[str],
                                           all_buffer_ptrs: Sequence[Sequence[int]],
                                           all_sizes: Sequence[Sequence[int]],
                                           all_src_offsets: Sequence[Sequence[int]]
                                           ) -> list[int]:
        """Key ``i``'s bytes ``[src, src+size)`` to ``all_buffer_ptrs[i][j]`` for each
        ``j`` (registered memory), from the replicas its session cached. Per key: the bytes
        copied, -600 (no session, ranges outside the object or its lists' lengths
        disagree, or a buffer outside registered memory), -707 when the lease lapsed (the
        session ends), or the transfer's error code."""
        keys = str_list(keys, "keys")
        ptrs = uint_lists(all_buffer_ptrs, "all_buffer_ptrs")
        sizes = uint_lists(all_sizes, "all_sizes")
        offs = uint_lists(all_src_offsets, "all_src_offsets")
        if self._client is None:
            return []
        out = [_INVALID_PARAMS] * len(keys)
        if not len(keys) == len(ptrs) == len(sizes) == len(offs):
            return out
        groups: dict[int, tuple[Any, list, list]] = {}  # id(reads) -> reads, ranges, keys
        with self._session_cv:
            for i, k in enumerate(keys):
                s = self._get_sessions.get(k)
                if s is None or not len(ptrs[i]) == len(sizes[i]) == len(offs[i]):
                    continue
                if any(_overflow(o, n, s.size) or (n > 0 and not self._registered(p, n))
                       for p, n, o in zip(ptrs[i], sizes[i], offs[i], strict=True)):
                    continue
                ranges = [(s.index, o, n, p) for p, n, o in zip(ptrs[i], sizes[i], offs[i],
                                                                strict=True) if n > 0]
                g = groups.setdefault(id(s.reads), (s.reads, [], []))
                g[1].extend(ranges)
                g[2].extend([i] * len(ranges))
                out[i] = sum(sizes[i])
        for reads, ranges, owners in groups.values():
            try:
                results = reads.read(ranges)
            except Exception as e:  # noqa: BLE001
                results = [e] * len(ranges)
            for i, r in zip(owners, results, strict=True):
                if r is not None and out[i] >= 0:
                    out[i] = _code(r)
        with self._session_cv:
            for i, k in enumerate(keys):
                if out[i] == _LEASE_EXPIRED:
                    self._drop_get(k)
        return out

    def batch_get_session_end(self, keys: Sequence[str]) -> int:
        """Drop the keys' cached replicas (and their read leases' bookkeeping): 0."""
        keys = str_list(keys, "keys")
        if self._client is None:
            return -1
        with self._session_cv:
            for k in keys:
                self._drop_get(k)
        return _OK

    # -- put sessions ------------------------------------------------------------------

    def batch_put_session_start(self, keys: Sequence[str], sizes: Sequence[int],
                                config: Any = None) -> list[int]:
        """Reserve each object (``sizes[i]`` bytes) on the master without writing it: 0 per
        key; -600 when the key already has a put session or the lists' lengths differ;
        -705 when the key exists; the master's code otherwise (-200 no space...)."""
        keys = str_list(keys, "keys")
        sizes = uint_list(sizes, "sizes")
        cfg = self._cfg(config)  # TypeError for a config of another type
        if self._client is None:
            return []
        if len(keys) != len(sizes):
            return [_INVALID_PARAMS] * len(keys)
        out = [_OK] * len(keys)
        for i, (k, n) in enumerate(zip(keys, sizes, strict=True)):
            with self._session_cv:
                if k in self._put_sessions:
                    out[i] = _INVALID_PARAMS
                    continue
            try:
                handle = self._client.put_start(k, n, cfg)
            except Exception as e:  # noqa: BLE001
                out[i] = _code(e)
                continue
            with self._session_cv:
                self._put_sessions[k] = _PutSession(handle, np.zeros(n, dtype=np.uint8))
        return out

    def batch_put_from_multi_buffer_ranges(self, keys: Sequence[str],
                                           all_buffer_ptrs: Sequence[Sequence[int]],
                                           all_sizes: Sequence[Sequence[int]],
                                           all_dst_offsets: Sequence[Sequence[int]]
                                           ) -> list[int]:
        """Write ``all_buffer_ptrs[i][j]``'s ``all_sizes[i][j]`` bytes (registered memory)
        at offset ``all_dst_offsets[i][j]`` of key ``i``'s reserved object, on every
        replica. Per key: the bytes written (counted once, not per replica), -600 (no open
        session, a range outside the object, lists of different lengths, a buffer outside
        registered memory), -702 for a key given no ranges, or -800 when a replica's
        transfer failed."""
        keys = str_list(keys, "keys")
        ptrs = uint_lists(all_buffer_ptrs, "all_buffer_ptrs")
        sizes = uint_lists(all_sizes, "all_sizes")
        offs = uint_lists(all_dst_offsets, "all_dst_offsets")
        c = self._client
        if c is None:
            return []
        out = [_INVALID_PARAMS] * len(keys)
        if not len(keys) == len(ptrs) == len(sizes) == len(offs):
            return out
        todo: list[tuple[int, _PutSession]] = []
        with self._session_cv:
            for i, k in enumerate(keys):
                s = self._put_sessions.get(k)
                if (s is None or not s.writable
                        or not len(ptrs[i]) == len(sizes[i]) == len(offs[i])):
                    continue
                if any(_overflow(o, n, s.shadow.nbytes) or (n > 0 and not self._registered(p, n))
                       for p, n, o in zip(ptrs[i], sizes[i], offs[i], strict=True)):
                    continue
                if not ptrs[i]:  # nothing to write: Mooncake submits no replica write
                    out[i] = _INVALID_REPLICA
                    continue
                s.inflight += 1
                todo.append((i, s))
        moves, owners = [], []
        try:
            for i, s in todo:
                base = int(s.shadow.ctypes.data)
                for p, n, o in zip(ptrs[i], sizes[i], offs[i], strict=True):
                    if n == 0:
                        continue
                    ctypes.memmove(base + o, p, n)
                    s.written.append((o, o + n))
                    for rep in s.handle.replicas:
                        local = (c._local_view(rep.addr + o, n)
                                 if rep.segment == c.segment_name else None)
                        if local is not None:  # our own segment: a memmove
                            ctypes.memmove(rep.addr + o, p, n)
                        else:
                            moves.append(Move(True, p, rep.segment, rep.addr + o, n))
                            owners.append(i)
                out[i] = sum(sizes[i])
            results = c._dp.run(moves) if moves else []
            for i, r in zip(owners, results, strict=True):
                if not r.ok:
                    out[i] = _TRANSFER_FAIL
        finally:
            with self._session_cv:
                for _, s in todo:
                    s.inflight -= 1
                self._session_cv.notify_all()
        return out

    def _seal(self, keys: list[str], out: list[int]) -> list[tuple[int, _PutSession]]:
        """Sessions of ``keys`` closed to range writes, once their writes in flight end;
        -600 in ``out`` for a key without one."""
        sealed = []
        with self._session_cv:
            for i, k in enumerate(keys):
                s = self._put_sessions.get(k)
                if s is None:
                    out[i] = _INVALID_PARAMS
                    continue
                s.writable = False
                sealed.append((i, s))
            self._session_cv.wait_for(lambda: all(s.inflight == 0 for _, s in sealed))
        return sealed

    def _fill_gaps(self, s: _PutSession) -> None:
        """Write zeros to every replica where no range was written (the shadow's zeros)."""
        c = self._client
        gaps, at = [], 0
        for a, b in sorted(s.written):
            if a > at:
                gaps.append((at, a))
            at = max(at, b)
        if at < s.shadow.nbytes:
            gaps.append((at, s.shadow.nbytes))
        for a, b in gaps:
            addr, arr, release = c._stage(b - a)
            try:
                arr[:] = 0
                moves = []
                for rep in s.handle.replicas:
                    local = (c._local_view(rep.addr + a, b - a)
                             if rep.segment == c.segment_name else None)
                    if local is not None:
                        local[:] = 0
                    else:
                        moves.append(Move(True, addr, rep.segment, rep.addr + a, b - a))
                if moves and not all(r.ok for r in c._dp.run(moves)):
                    raise StoreError(ErrorCode.TRANSFER_FAIL, "zero-fill of a put session")
            finally:
                release()
        s.written = [(0, s.shadow.nbytes)]

    def batch_put_session_end(self, keys: Sequence[str]) -> list[int]:
        """Publish the reserved objects (readable from now): 0 per key; -600 without a
        session; the master's code otherwise (the session is kept: end or revoke again)."""
        keys = str_list(keys, "keys")
        c = self._client
        if c is None:
            return []
        out = [_OK] * len(keys)
        for i, s in self._seal(keys, out):
            h = s.handle
            try:
                self._fill_gaps(s)
                if _digests is not None:
                    c.put_end(h.key, h.generation, _digests(s.shadow))
                else:  # pragma: no cover - a tree without store.checksum
                    c.put_end(h.key, h.generation)
            except Exception as e:  # noqa: BLE001
                out[i] = _code(e)
                continue
            with self._session_cv:
                self._put_sessions.pop(keys[i], None)
        return out

    def batch_put_session_revoke(self, keys: Sequence[str]) -> list[int]:
        """Abort the reservations (their space is freed, nothing becomes readable): 0 per
        key (also when the master no longer knows it); -600 without a session."""
        keys = str_list(keys, "keys")
        c = self._client
        if c is None:
            return []
        out = [_OK] * len(keys)
        for i, s in self._seal(keys, out):
            try:
                c.put_revoke(s.handle.key, s.handle.generation)
            except StoreError as e:
                if e.code != ErrorCode.OBJECT_NOT_FOUND:
                    out[i] = _code(e)
                    continue
            except Exception as e:  # noqa: BLE001
                out[i] = _code(e)
                continue
            with self._session_cv:
                self._put_sessions.pop(keys[i], None)
        return out

    def _end_sessions(self) -> None:
        """At ``close``: revoke open put sessions, drop get sessions."""
        if self._put_sessions:
            self.batch_put_session_revoke(list(self._put_sessions))
        with self._session_cv:
            for k in list(self._get_sessions):
                self._drop_get(k)
