"""Write methods of ``MooncakeDistributedStore``: put, upsert (size may change), the
``_from`` zero-copy forms and multi-buffer puts, with Mooncake's return codes."""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from pymooncake.store.compat._codes import EXISTS as _EXISTS
from pymooncake.store.compat._codes import INVALID_PARAMS as _INVALID_PARAMS
from pymooncake.store.compat._codes import OK as _OK
from pymooncake.store.compat._codes import buffer_nbytes as _buffer_nbytes
from pymooncake.store.compat._codes import code as _code
from pymooncake.store.compat._codes import put_code as _put_code
from pymooncake.store.compat._types import ReplicateConfig, incompatible
from pymooncake.store.config import ReplicateConfig as _TypedReplicateConfig
from pymooncake.store.errors import ErrorCode, StoreError


class WriteMethods:
    """Mixed into ``MooncakeDistributedStore``."""

    client: Any
    _local_buffer_size: int
    _registered: Any
    _place_exact: Any

    # -- put / upsert ------------------------------------------------------------------

    def _cfg(self, config: ReplicateConfig | None) -> _TypedReplicateConfig:
        if config is not None and not isinstance(config, ReplicateConfig):
            raise incompatible("put", "config", config, "ReplicateConfig")
        typed = (config or ReplicateConfig()).to_typed()
        prefer = getattr(self, "_prefer_segment", "")  # a dummy client's real client
        if prefer and not typed.preferred_segment:
            typed = dataclasses.replace(typed, preferred_segment=prefer)
        return typed

    def _exact_put(self, keys: Sequence[str], values: Sequence[Any],
                   config: ReplicateConfig | None) -> list[int] | None:
        """Puts honouring several ``preferred_segments`` (one replica on each), or None
        when the config names fewer than two."""
        segs = list(dict.fromkeys(config.preferred_segments)) if config is not None else []
        if len(segs) < 2 or config is None or config.replica_num < 2:
            return None
        segs = segs[:config.replica_num]
        out = []
        for k, v in zip(keys, values, strict=True):
            if self.client.batch_exist([k])[0] is True:
                out.append(_OK)  # Mooncake: a put of an existing key keeps the old value
                continue
            out.append(self._place_exact(k, bytes(memoryview(v).cast("B")), segs, config))
        return out

    def _put_values(self, keys: Sequence[str], values: Sequence[Any],
                    config: ReplicateConfig | None, upsert: bool) -> list[int]:
        """Codes per key. Values go through the local buffer: one larger than
        ``local_buffer_size`` is -600 (as Mooncake). Raises TypeError for bad types."""
        sizes = [_buffer_nbytes(v) for v in values]
        if len(keys) != len(values):
            return [_code(ValueError(f"{len(keys)} keys but {len(values)} values"))] * max(
                len(keys), 1)
        if config is not None and not isinstance(config, ReplicateConfig):
            raise incompatible("put", "config", config, "ReplicateConfig")  # as pybind11
        try:
            cfg = self._cfg(config)
            if any(n > self._local_buffer_size for n in sizes):
                return [_code(ValueError(
                    f"a value of {max(sizes)} bytes is larger than local_buffer_size "
                    f"({self._local_buffer_size} bytes)"))] * len(keys)
            if upsert:
                return self._upsert(list(keys), lambda ks, ix: self.client.batch_put(
                    ks, [values[i] for i in ix], cfg))
            exact = self._exact_put(keys, values, config)
            if exact is not None:
                return exact
            return [_put_code(e) for e in self.client.batch_put(list(keys), list(values), cfg)]
        except Exception as e:  # noqa: BLE001
            return [_code(e)] * len(keys)

    def _upsert(self, keys: list[str],
                put: Callable[[list[str], list[int]], list[StoreError | None]]) -> list[int]:
        """Insert or replace (the size may change): put; a key that exists is removed
        (forced, leases do not block an upsert) and put again. A reader between the two
        sees a miss, never mixed bytes."""
        out = [_OK] * len(keys)
        todo = list(range(len(keys)))
        for _ in range(3):
            errs = put([keys[i] for i in todo], todo)
            again = []
            for i, e in zip(todo, errs, strict=True):
                if e is not None and e.code == _EXISTS:
                    try:
                        self.client.remove(keys[i], force=True)
                    except StoreError as r:
                        if r.code != ErrorCode.OBJECT_NOT_FOUND:
                            out[i] = _code(r)
                            continue
                    again.append(i)
                else:
                    out[i] = _put_code(e)
            if not again:
                return out
            todo = again
        for i in todo:
            out[i] = int(_EXISTS)  # another writer kept winning the key
        return out

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        return self._put_values([key], [value], config, False)[0]

    def put_batch(self, keys: Sequence[str], values: Sequence[Any],
                  config: ReplicateConfig | None = None) -> int:
        """0 when every put succeeded, else the first error code."""
        return next((c for c in self._put_values(keys, values, config, False) if c), _OK)

    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """The parts, concatenated, as one object. No parts: 0 and nothing stored."""
        if not parts:
            return _OK
        return self.put(key, b"".join(memoryview(p).cast("B") for p in parts), config)

    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Insert or replace ``key`` (its size may change). 0 on success."""
        return self._put_values([key], [value], config, True)[0]

    def upsert_batch(self, keys: Sequence[str], values: Sequence[Any],
                     config: ReplicateConfig | None = None) -> int:
        return next((c for c in self._put_values(keys, values, config, True) if c), _OK)

    def upsert_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None
                     ) -> int:
        if not parts:
            return _OK
        return self.upsert(key, b"".join(memoryview(p).cast("B") for p in parts), config)

    def put_from(self, key: str, buffer_ptr: int, size: int,
                 config: ReplicateConfig | None = None) -> int:
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    def put_from_with_metadata(self, key: str, buffer_ptr: int, metadata_buffer_ptr: int,
                               size: int, metadata_size: int,
                               config: ReplicateConfig | None = None) -> int:
        """One object: ``metadata_size`` bytes at ``metadata_buffer_ptr`` then ``size``
        bytes at ``buffer_ptr`` (both in registered memory). 0 on success (also for an
        existing key, which keeps its value; ``size == 0`` stores nothing), -1 with
        ``prefer_alloc_in_same_node`` or before ``setup`` (Mooncake's RealClient), -600
        for memory outside registered buffers."""
        for name, v in (("buffer_ptr", buffer_ptr), ("metadata_buffer_ptr",
                        metadata_buffer_ptr), ("size", size), ("metadata_size", metadata_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise TypeError(f"{name}: expected an unsigned int, got {v!r}")
        typed = self._cfg(config)
        if getattr(self, "_client", None) is None:
            return _INVALID_PARAMS  # the pybind wrapper's answer before setup
        if config is not None and config.prefer_alloc_in_same_node:
            return -1
        if size == 0:
            return _OK
        if not (self._registered(buffer_ptr, size) and (
                metadata_size == 0 or self._registered(metadata_buffer_ptr, metadata_size))):
            return _INVALID_PARAMS
        value = ctypes.string_at(metadata_buffer_ptr, metadata_size) + ctypes.string_at(
            buffer_ptr, size)
        try:
            return _put_code(self.client.batch_put([key], [value], typed)[0])
        except Exception as e:  # noqa: BLE001
            return _code(e)

    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                       sizes: Sequence[int], config: ReplicateConfig | None = None
                       ) -> list[int]:
        """Zero copy from registered memory; one code per key."""
        try:
            errs = self.client.batch_put_from(list(keys), list(buffer_ptrs), list(sizes),
                                              self._cfg(config))
        except Exception as e:  # noqa: BLE001
            return [_code(e)] * len(keys)
        return [_put_code(e) for e in errs]

    def upsert_from(self, key: str, buffer_ptr: int, size: int,
                    config: ReplicateConfig | None = None) -> int:
        return self.batch_upsert_from([key], [buffer_ptr], [size], config)[0]

    def batch_upsert_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                          sizes: Sequence[int], config: ReplicateConfig | None = None
                          ) -> list[int]:
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [_INVALID_PARAMS] * len(keys)
        try:
            cfg = self._cfg(config)
            return self._upsert(list(keys), lambda ks, ix: self.client.batch_put_from(
                ks, [buffer_ptrs[i] for i in ix], [sizes[i] for i in ix], cfg))
        except Exception as e:  # noqa: BLE001
            return [_code(e)] * len(keys)

    def batch_put_from_multi_buffers(self, keys: Sequence[str],
                                     all_buffer_ptrs: Sequence[Sequence[int]],
                                     all_sizes: Sequence[Sequence[int]],
                                     config: ReplicateConfig | None = None) -> list[int]:
        """Each object is the concatenation of its registered pieces; one code per key."""
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes):
            return [_INVALID_PARAMS] * len(keys)
        try:
            cfg = self._cfg(config)
            c = self.client
            out = [_OK] * len(keys)
            idx, vals = [], []
            for i, (ptrs, sizes) in enumerate(zip(all_buffer_ptrs, all_sizes, strict=True)):
                if (len(ptrs) != len(sizes) or not ptrs or any(s <= 0 for s in sizes)
                        or not all(self._registered(p, s) for p, s in zip(ptrs, sizes,
                                                                           strict=True))):
                    out[i] = _INVALID_PARAMS
                    continue
                idx.append(i)
                vals.append(b"".join(ctypes.string_at(p, s) for p, s in zip(ptrs, sizes,
                                                                             strict=True)))
            errs = c.batch_put([keys[i] for i in idx], vals, cfg) if idx else []
            for i, e in zip(idx, errs, strict=True):
                out[i] = _put_code(e)
            return out
        except Exception as e:  # noqa: BLE001
            return [_code(e)] * len(keys)

