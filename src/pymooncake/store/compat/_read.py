"""Read, metadata and remove methods of ``MooncakeDistributedStore``: get forms,
``_into`` zero-copy reads, buffer registration, existence/size/replica queries, removes,
with Mooncake's return codes."""

from __future__ import annotations

import contextlib
import ctypes
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from pymooncake.store.compat._codes import INVALID_PARAMS as _INVALID_PARAMS
from pymooncake.store.compat._codes import OK as _OK
from pymooncake.store.compat._codes import code as _code
from pymooncake.store.compat._types import (
    BufferHandle,
    Descriptor,
    DiskDescriptor,
    MemoryDescriptor,
    ReplicaDescriptor,
    ReplicaStatus,
    bool_arg,
)
from pymooncake.store.errors import StoreError
from pymooncake.store.protocol import TIER_DRAM


class ReadMethods:
    """Mixed into ``MooncakeDistributedStore``."""

    client: Any
    _local_buffer_size: int
    _registered: Any
    _in_pool: Any

    # -- get ---------------------------------------------------------------------------

    def _values(self, keys: Sequence[str]) -> list[bytes | int]:
        """The bytes of each key, or its error code (reads go through the local buffer,
        so a client with ``local_buffer_size=0`` reads nothing, as Mooncake)."""
        if self._local_buffer_size == 0:
            return [_INVALID_PARAMS] * len(keys)
        try:
            vals = self.client.batch_get(list(keys))
        except Exception as e:  # noqa: BLE001
            return [_code(e)] * len(keys)
        return [_code(v) if isinstance(v, StoreError) else v for v in vals]

    def get(self, key: str) -> bytes:
        """The value, or ``b''`` when missing or on any error (as Mooncake)."""
        return self.get_batch([key])[0]

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        return [v if isinstance(v, bytes) else b"" for v in self._values(keys)]

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The object's bytes in a buffer this process owns (``ptr()``, ``size()``,
        buffer protocol), or None."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: Sequence[str]) -> list[BufferHandle | None]:
        return [np.frombuffer(bytearray(v), dtype=np.uint8).view(BufferHandle)
                if isinstance(v, bytes) else None for v in self._values(keys)]

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Bytes read, -600 when the buffer is too small, -704 when missing."""
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                       sizes: Sequence[int]) -> list[int]:
        try:
            vals = self.client.batch_get_into(list(keys), list(buffer_ptrs), list(sizes))
        except Exception as e:  # noqa: BLE001
            return [_code(e)] * len(keys)
        return [_code(v) if isinstance(v, StoreError) else int(v) for v in vals]

    def batch_get_into_multi_buffers(self, keys: Sequence[str],
                                     all_buffer_ptrs: Sequence[Sequence[int]],
                                     all_sizes: Sequence[Sequence[int]],
                                     prefer_alloc_in_same_node: bool = False) -> list[int]:
        """Each object scattered over its registered buffers in order; the object's size
        per key, -600 when the buffers hold less, -704 when missing."""
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes):
            return [_INVALID_PARAMS] * len(keys)
        out: list[int] = []
        for v, ptrs, sizes in zip(self._values(keys), all_buffer_ptrs, all_sizes,
                                  strict=True):
            if not isinstance(v, bytes):
                out.append(v)
                continue
            if (len(ptrs) != len(sizes) or sum(sizes) < len(v)
                    or not all(self._registered(p, s) for p, s in zip(
                        ptrs, sizes, strict=True) if s > 0)):
                out.append(_INVALID_PARAMS)
                continue
            off = 0
            for p, s in zip(ptrs, sizes, strict=True):
                n = min(s, len(v) - off)
                if n <= 0:
                    break
                ctypes.memmove(p, v[off:off + n], n)
                off += n
            out.append(len(v))
        return out

    def get_into_ranges(self, buffer_ptrs: Sequence[int], all_keys: Sequence[Sequence[str]],
                        all_dst_offsets: Sequence[Sequence[Sequence[int]]],
                        all_src_offsets: Sequence[Sequence[Sequence[int]]],
                        all_sizes: Sequence[Sequence[Sequence[int]]]
                        ) -> list[list[list[int]]]:
        """For buffer ``i`` and its key ``j``, copy object bytes ``[src, src+size)`` to
        ``buffer_ptrs[i] + dst`` for each range; bytes copied per range, or a code
        (-704 missing, -600 out of the object or of registered memory)."""
        uniq = list(dict.fromkeys(k for ks in all_keys for k in ks))
        got = dict(zip(uniq, self._values(uniq), strict=True)) if uniq else {}
        n_buf = len(buffer_ptrs)
        if not n_buf == len(all_keys) == len(all_dst_offsets) == len(all_src_offsets) == len(
                all_sizes):  # every buffer's every key answers -600
            return [[[_INVALID_PARAMS] for _ in ks] for ks in all_keys]
        out: list[list[list[int]]] = []
        for base, keys, dsts, srcs, sizes in zip(buffer_ptrs, all_keys, all_dst_offsets,
                                                 all_src_offsets, all_sizes, strict=True):
            if not len(keys) == len(dsts) == len(srcs) == len(sizes):
                out.append([[_INVALID_PARAMS] for _ in keys])
                continue
            per_key = []
            for k, d_l, s_l, n_l in zip(keys, dsts, srcs, sizes, strict=True):
                v = got[k]
                if not len(d_l) == len(s_l) == len(n_l):  # a key's ranges disagree: -600
                    per_key.append([_INVALID_PARAMS] * max(len(d_l), len(s_l), len(n_l)))
                    continue
                codes = []
                for d, s_, n in zip(d_l, s_l, n_l, strict=True):
                    if not isinstance(v, bytes):
                        codes.append(v)
                    elif (n < 0 or s_ < 0 or d < 0 or s_ + n > len(v)
                          or not self._registered(base + d, max(n, 1))):
                        codes.append(_INVALID_PARAMS)
                    else:
                        ctypes.memmove(base + d, v[s_:s_ + n], n)
                        codes.append(n)
                per_key.append(codes)
            out.append(per_key)
        return out

    # -- memory ------------------------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """0 on success; memory from ``alloc_from_mem_pool`` is registered already (0)."""
        if self._in_pool(int(buffer_ptr), int(size)):
            return _OK
        try:
            self.client.register_memory(int(buffer_ptr), int(size))
        except Exception as e:  # noqa: BLE001
            return _code(e)
        return _OK

    def unregister_buffer(self, buffer_ptr: int) -> int:
        if self._in_pool(int(buffer_ptr), 1):
            return _OK  # pool memory stays registered until close
        try:
            self.client.unregister_buffer(int(buffer_ptr))
        except Exception as e:  # noqa: BLE001
            return _code(e)
        return _OK

    # -- metadata ----------------------------------------------------------------------

    def is_exist(self, key: str) -> int:
        """1 present, 0 absent, -1 error."""
        try:
            return 1 if self.client.exist(key) else 0
        except Exception:  # noqa: BLE001
            return -1

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        try:
            vals = self.client.batch_exist(keys)  # a list already (typed_keys)
        except Exception:  # noqa: BLE001
            return [-1] * len(keys)
        return [1 if v is True else 0 if v is False else
                -1 if isinstance(v, StoreError) else int(bool(v)) for v in vals]

    def get_size(self, key: str) -> int:
        try:
            return self.client.get_size(key)
        except Exception as e:  # noqa: BLE001
            return _code(e)

    def get_replica_desc(self, key: str) -> list[ReplicaDescriptor]:
        """The object's replicas (``[]`` when missing); grants a read lease, as Mooncake's
        ``GetReplicaList``."""
        try:
            rl = self.client.replica_list(key)
        except Exception:  # noqa: BLE001
            return []
        out = []
        for r in rl.replicas:
            status = ReplicaStatus.__members__.get(r.status, ReplicaStatus.COMPLETE)
            if r.tier == TIER_DRAM:
                out.append(ReplicaDescriptor(status, mem=MemoryDescriptor(
                    Descriptor(r.addr, r.length, r.segment))))
            else:
                out.append(ReplicaDescriptor(status, disk=DiskDescriptor(
                    f"{r.segment}/{r.tier}/{key}", r.length)))
        return out

    def batch_get_replica_desc(self, keys: Sequence[str]) -> dict[str, list[ReplicaDescriptor]]:
        """Key → replicas, for the keys that exist."""
        out = {}
        for k in keys:
            d = self.get_replica_desc(k)
            if d:
                out[k] = d
        return out

    # -- remove ------------------------------------------------------------------------

    def remove(self, key: str, force: bool = False) -> int:
        """0; -706 while a read lease is held (unless ``force``); -704 when missing; -703
        while the object is still being written (also with ``force``). ``force`` is taken
        as a bool the way the wheel's binding converts it (``1`` is ``True``); a value with
        no truth conversion of that kind raises ``TypeError``."""
        if type(force) is not bool:
            force = bool_arg("remove", "force", force)
        try:
            self.client.remove(key, force)
        except Exception as e:  # noqa: BLE001
            return _code(e)
        return _OK

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        force = bool_arg("batch_remove", "force", force)
        return [self.remove(k, force) for k in keys]

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """Removes every key the pattern matches (searched anywhere in the key); the count,
        or -600 for a pattern that does not compile. Leased keys stay unless ``force``."""
        force = bool_arg("remove_by_regex", "force", force)
        try:
            rx = re.compile(regex_pattern)
            keys = self.client.list_keys()
        except re.error:
            return _INVALID_PARAMS
        except Exception as e:  # noqa: BLE001
            return _code(e)
        return sum(self.remove(k, force) == _OK for k in keys if rx.search(k))

    def remove_all(self, force: bool = False) -> int:
        """Number of objects removed (or a negative code)."""
        force = bool_arg("remove_all", "force", force)
        try:
            return self.client.remove_all(force)
        except Exception as e:  # noqa: BLE001
            return _code(e)

    def batch_replica_clear(self, keys: Sequence[str], segment_name: str = "") -> list[str]:
        """Drops the replicas of keys whose lease has lapsed; the keys cleared. With a
        ``segment_name``, only a key whose every replica lies on that segment is cleared
        (pymooncake's master cannot drop one replica of several)."""
        cleared = []
        for k in keys:
            if segment_name:
                descs = self.get_replica_desc(k)
                with contextlib.suppress(Exception):
                    self.client.release_leases([k])  # ours, taken just now
                if not descs or any(d.is_memory_replica() and d.get_memory_descriptor()
                                    .buffer_descriptor.transport_endpoint != segment_name
                                    for d in descs):
                    continue
            if self.remove(k) == _OK:
                cleared.append(k)
        return cleared

