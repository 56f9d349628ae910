"""The unified-parallelism reads of ``MooncakeDistributedStore``:
``get_tensor_with_parallelism(key, target)`` and its batch and ``_into`` forms, driven by a
``ReadTarget`` (Mooncake's docs/source/design/store/unified-parallel-tensor-io.md, "Read
side"):

- ``target=None`` or ``mode="as_stored"``: the object stored at ``key`` (or, with
  ``parallelism``, at that shard's key), as stored;
- ``mode="shard"``: the shard ``parallelism`` names. When the stored shard set has that
  very layout it is the stored shard; otherwise (another TP size or split dim: re-sharding)
  it is cut from the stored shards it overlaps, found through the set's manifest. A
  ``split_dim`` extent not divisible by the target TP size, or any missing shard, is None;
- ``mode="full"``: the whole tensor, rebuilt by joining every stored shard of the set
  (the set is named by the target's non-TP axes; with no ``parallelism``: the full object at
  ``key``, else the writer-partition set, else the single-TP set under ``key``).

Results are torch tensors (numpy arrays when torch is not loaded); a miss is None. The
``_into`` forms write the result object (304-byte metadata + data) into registered memory
at ``buffer_ptr`` and return a tensor viewing it; None when it does not fit in ``size``."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import Any

from pymooncake.store.compat import _parallel_spec as ps
from pymooncake.store.compat import _tensor

logger = logging.getLogger(__name__)

# (dtype, global shape, split dim, shard count, shard keys)
Layout = tuple[int, tuple[int, ...], int, int, list[str]]


class ParallelReadMethods:
    """Mixed into ``MooncakeDistributedStore``; uses its byte reads."""

    get: Any
    get_batch: Any
    _registered: Any

    def _obj(self, key: str) -> bytes | None:
        data = self.get(key)
        return data if data and _tensor.parse(data, len(data)) is not None else None

    def _layout(self, key: str, axes: list[ps.Axis]) -> Layout | None:
        """The stored shard set the target's non-TP axes name: its TP size, split dim and
        global shape from ``key``'s manifest (one per key, as Mooncake's), its shard keys
        from the target's non-TP axes."""
        group = ps.group_key(key, axes)
        mkeys = [key + "__parallelism_manifest"]
        if group == key:
            mkeys.append(key + "__writer_manifest")
        for i, raw in enumerate(self.get_batch(mkeys)):
            m = ps.parse_manifest(raw) if raw else None
            if m is None:
                continue
            dtype, glob, dim, count = m
            if i == 0:
                keys = [ps.shard_key(key, ps.with_tp(axes, j, count, dim))
                        for j in range(count)]
            else:
                keys = [ps.writer_key(key, j, count, dim) for j in range(count)]
            return dtype, glob, dim, count, keys
        if group != key:
            return None
        # no manifest: shards of the *_with_tp wrappers; rank 0's metadata has the layout
        data = self.get(f"{key}_tp_0")
        m = _tensor.parse(data, len(data)) if data else None
        tp = next((a for a in m.axes if a[0] == ps.KINDS["tp"]), None) if m and \
            m.kind == _tensor.SHARD else None
        if m is None or tp is None or not 0 <= tp[3] < len(m.global_shape):
            return None
        return (m.dtype, m.global_shape, tp[3], tp[2],
                [f"{key}_tp_{j}" for j in range(tp[2])])

    def _gather(self, lay: Layout, lo: int, hi: int) -> tuple[bytes, tuple[int, ...]] | None:
        """Elements ``[lo, hi)`` along the set's split dim, from the shards covering them."""
        dtype, glob, dim, count, keys = lay
        ext = glob[dim] // count
        if ext * count != glob[dim] or not 0 <= lo < hi <= glob[dim]:
            return None
        j0, j1 = lo // ext, -(-hi // ext)
        isz = ps.itemsize(dtype)
        want = glob[:dim] + (ext,) + glob[dim + 1:]
        parts = []
        for j, data in zip(range(j0, j1), self.get_batch(keys[j0:j1]), strict=True):
            m = _tensor.parse(data, len(data)) if data else None
            if m is None or m.dtype != dtype or m.local_shape != want:
                return None
            raw = memoryview(data)[m.data_offset:m.data_offset + m.data_bytes]
            a, b = max(lo, j * ext) - j * ext, min(hi, (j + 1) * ext) - j * ext
            parts.append(ps.slice_dim(raw, want, dim, a, b, isz) if (a, b) != (0, ext)
                         else (raw, want))
        return ps.concat_dim(parts, dim, isz)

    def _shard(self, key: str, axes: list[ps.Axis]) -> bytes | None:
        tp = ps.tp_of(axes)
        lay = self._layout(key, axes) if tp is not None else None
        if tp is None or lay is None:
            return self._obj(ps.shard_key(key, axes))
        dtype, glob, sdim, count, keys = lay
        d = tp.split_dim
        assert d is not None
        if d >= len(glob) or glob[d] % tp.size:
            return None
        if d == sdim and count == tp.size:
            return self._obj(keys[tp.rank])
        step = glob[d] // tp.size
        lo, hi = tp.rank * step, (tp.rank + 1) * step
        if d == sdim:
            got = self._gather(lay, lo, hi)
        else:  # another split dim: rebuild, then cut
            full = self._gather(lay, 0, glob[sdim])
            got = None if full is None else ps.slice_dim(full[0], glob, d, lo, hi,
                                                         ps.itemsize(dtype))
        if got is None:
            return None
        data, shape = got
        return _tensor.metadata(dtype, shape, len(data), global_shape=glob,
                                kind=_tensor.SHARD,
                                axes=tuple(a.layout() for a in axes)) + data

    def _full(self, key: str, axes: list[ps.Axis] | None) -> bytes | None:
        if axes is None:
            obj = self._obj(key)
            m = _tensor.parse(obj, len(obj)) if obj else None
            if m is not None and m.kind == _tensor.FULL:
                return obj
        elif ps.tp_of(axes) is None:  # tags only: the object is stored whole
            obj = self._obj(ps.shard_key(key, axes))
            m = _tensor.parse(obj, len(obj)) if obj else None
            return None if m is None else _tensor.metadata(m.dtype, m.local_shape,
                                                           m.data_bytes) + obj[m.data_offset:]
        lay = self._layout(key, axes or [])
        got = None if lay is None else self._gather(lay, 0, lay[1][lay[2]])
        if got is None:
            return None
        data, shape = got
        return _tensor.metadata(lay[0], shape, len(data)) + data

    def _resolve(self, key: str, target: Any) -> bytes | None:
        """The serialised result object of one read, or None."""
        if target is None:
            return self._obj(key)
        if not (hasattr(target, "mode") and hasattr(target, "parallelism")):
            # Mooncake takes any object here (py::object, parse_read_target_spec in
            # store_py_internal.h): no TypeError, this log line and None
            logger.error("%s: ReadTarget must provide mode and parallelism, got %r", key,
                         target)
            return None
        mode, par = getattr(target, "mode", None), getattr(target, "parallelism", None)
        mode = mode.lower() if isinstance(mode, str) else None
        if mode not in ("as_stored", "shard", "full"):
            logger.error("%s: a ReadTarget needs mode as_stored/shard/full", key)
            return None
        axes = None
        if par is not None:
            axes = ps.validate(par)
            if axes is None:
                logger.error("%s: invalid ReadTarget parallelism", key)
                return None
        if mode == "as_stored":
            return self._obj(key if axes is None else ps.shard_key(key, axes))
        if mode == "shard":
            if axes is None:
                logger.error("%s: a shard read needs target.parallelism", key)
                return None
            return self._shard(key, axes)
        return self._full(key, axes)

    def _targets(self, n: int, targets: Any) -> list[Any] | None:
        out = [None] * n if targets is None else list(targets)
        return out if len(out) == n else None

    def _into(self, obj: bytes | None, ptr: int, size: int) -> Any:
        if obj is None or len(obj) > size or not ptr or not self._registered(ptr, len(obj)):
            return None
        ctypes.memmove(ptr, obj, len(obj))
        return _tensor.tensor_at(ptr, len(obj))

    # -- the public forms --------------------------------------------------------------

    def get_tensor_with_parallelism(self, key: str, target: Any = None) -> Any:
        """The tensor ``target`` asks for (see the module doc), or None."""
        obj = self._resolve(key, target)
        return None if obj is None else _tensor.tensor_from(obj)

    def batch_get_tensor_with_parallelism(self, keys: Sequence[str], targets: Any = None
                                          ) -> list[Any]:
        ts = self._targets(len(keys), targets)
        if ts is None:
            return [None] * len(keys)
        return [self.get_tensor_with_parallelism(k, t) for k, t in zip(keys, ts, strict=True)]

    def get_tensor_with_parallelism_into(self, key: str, buffer_ptr: int, size: int,
                                         target: Any = None) -> Any:
        """The result written at ``buffer_ptr`` (registered, ``size`` bytes) and a tensor
        viewing it, or None."""
        return self._into(self._resolve(key, target), buffer_ptr, size)

    def batch_get_tensor_with_parallelism_into(self, keys: Sequence[str],
                                               buffer_ptrs: Sequence[int],
                                               sizes: Sequence[int], targets: Any = None
                                               ) -> list[Any]:
        ts = self._targets(len(keys), targets)
        if ts is None or not len(keys) == len(buffer_ptrs) == len(sizes):
            return [None] * len(keys)
        return [self.get_tensor_with_parallelism_into(k, p, n, t)
                for k, p, n, t in zip(keys, buffer_ptrs, sizes, ts, strict=True)]
