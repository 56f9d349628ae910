"""The unified-parallelism write methods of ``MooncakeDistributedStore``
(``put_tensor_with_parallelism`` / ``upsert_tensor_with_parallelism``, their batch and
``_from`` forms); the reads are in ``_parallel_read``. As Mooncake
(docs/source/design/store/unified-parallel-tensor-io.md):

- no ``parallelism`` and no ``writer_partition``: the tensor is one full object at ``key``;
- a single TP axis: the tensor *is* rank ``rank``'s shard, stored at ``f"{key}_tp_{rank}"``
  (the ``*_with_tp`` layout; global shape = the shard's with ``split_dim`` × ``size``);
- several axes including TP: the tensor is the *full* tensor, of which this call stores
  TP rank ``rank``'s ``tensor.chunk(size, split_dim)`` piece (``shape[split_dim]`` must be
  divisible by ``size``);
- axes without TP (e.g. ``[EP]``, ``[DP]``): the tensor is stored as given, tagged;
- ``writer_partition`` (rank, size, split_dim): the full tensor, of which this call stores
  piece ``rank`` (divisible, as above) at ``f"{key}__writer_{rank}of{size}_sd{split_dim}"``.

Each shard write also upserts its shard set's manifest (``_parallel_spec``). An invalid
axis list, a non-divisible split, or ``parallelism`` together with ``writer_partition``
answer -600 (INVALID_PARAMS) and store nothing; a batch answers per item."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import Any

from pymooncake.store.compat import _parallel_spec as ps
from pymooncake.store.compat import _tensor
from pymooncake.store.compat._parallel_read import ParallelReadMethods
from pymooncake.store.compat._types import ReplicateConfig

_INVALID_PARAMS = -600
logger = logging.getLogger(__name__)


def _items(what: str, n: int, specs: Any) -> list[Any] | None:
    """A per-item list of specs (None = all None); None when the length is wrong."""
    if specs is None:
        return [None] * n
    out = list(specs)
    if len(out) != n:
        logger.error("%s: %d keys but %d specs", what, n, len(out))
        return None
    return out


class TensorParallelMethods(ParallelReadMethods):
    """Mixed into ``MooncakeDistributedStore``; uses its tensor and byte methods."""

    put: Any
    upsert: Any
    _tensor_write: Any
    _registered: Any

    def _par_one(self, key: str, tensor: Any, parallelism: Any, writer: Any, config: Any,
                 upsert: bool) -> int:
        if parallelism is not None and writer is not None:
            logger.error("%s: parallelism and writer_partition are exclusive", key)
            return _INVALID_PARAMS
        if parallelism is None and writer is None:
            return self._tensor_write([key], [tensor], config, upsert)[0]
        try:
            dtype, shape, raw = _tensor.raw_of(tensor)
        except (TypeError, ValueError):
            return _INVALID_PARAMS
        write = self.upsert if upsert else self.put
        isz = ps.itemsize(dtype)
        if writer is not None:
            w = ps.writer_spec(writer, len(shape))
            if w is None or shape[w[2]] % w[1]:
                logger.error("%s: invalid or non-uniform writer_partition", key)
                return _INVALID_PARAMS
            rank, size, dim = w
            step = shape[dim] // size
            data, sub = ps.slice_dim(raw, shape, dim, rank * step, (rank + 1) * step, isz)
            axis = ps.Axis("tp", rank, size, dim, None, None)
            return self._store_shard(write, ps.writer_key(key, rank, size, dim),
                                     f"{key}__writer_manifest", dtype, shape, sub, data,
                                     [axis], dim, size, config)
        axes = ps.validate(parallelism)
        if axes is None:
            logger.error("%s: invalid parallelism %r", key, parallelism)
            return _INVALID_PARAMS
        tp = ps.tp_of(axes)
        if tp is None:  # ownership tags only: stored as given
            return self._store_shard(write, ps.shard_key(key, axes), None, dtype, shape,
                                     shape, raw, axes, 0, 1, config)
        dim = tp.split_dim
        assert dim is not None
        if not 0 <= dim < len(shape):
            logger.error("%s: invalid parallelism: split_dim %d is outside a %d-D tensor's "
                         "dims [0, %d)", key, dim, len(shape), len(shape))
            return _INVALID_PARAMS
        if len(axes) == 1:  # the caller's tensor is the shard
            glob = shape[:dim] + (shape[dim] * tp.size,) + shape[dim + 1:]
            return self._store_shard(write, ps.shard_key(key, axes),
                                     f"{key}__parallelism_manifest", dtype, glob, shape,
                                     raw, axes, dim, tp.size, config)
        if shape[dim] % tp.size:
            logger.error("%s: dim %d of %s is not divisible by tp size %d", key, dim, shape,
                         tp.size)
            return _INVALID_PARAMS
        step = shape[dim] // tp.size
        data, sub = ps.slice_dim(raw, shape, dim, tp.rank * step, (tp.rank + 1) * step, isz)
        return self._store_shard(write, ps.shard_key(key, axes),
                                 f"{key}__parallelism_manifest", dtype, shape, sub, data,
                                 axes, dim, tp.size, config)

    def _store_shard(self, write: Any, skey: str, mkey: str | None, dtype: int,
                     glob: tuple[int, ...], local: tuple[int, ...], data: Any,
                     axes: list[ps.Axis], dim: int, count: int, config: Any) -> int:
        obj = _tensor.metadata(dtype, local, len(memoryview(data).cast("B")),
                               global_shape=glob, kind=_tensor.SHARD,
                               axes=tuple(a.layout() for a in axes)) + bytes(data)
        rc = write(skey, obj, config)
        if rc == 0 and mkey is not None:
            rc = self.upsert(mkey, ps.manifest(dtype, glob, dim, count), config)
        return rc

    def _par_write(self, what: str, keys: Sequence[str], tensors: Sequence[Any],
                   parallelisms: Any, writers: Any, config: Any, upsert: bool) -> list[int]:
        n = len(keys)
        pars, ws = _items(what, n, parallelisms), _items(what, n, writers)
        if pars is None or ws is None or len(tensors) != n:
            return [_INVALID_PARAMS] * n
        return [self._par_one(k, t, p, w, config, upsert)
                for k, t, p, w in zip(keys, tensors, pars, ws, strict=True)]

    def _par_from(self, what: str, keys: Sequence[str], ptrs: Sequence[int],
                  sizes: Sequence[int], parallelisms: Any, writers: Any, config: Any,
                  upsert: bool) -> list[int]:
        """The full tensor objects at ``[ptr, +size)`` (registered memory), written as
        ``_par_write`` writes tensors."""
        n = len(keys)
        if not n == len(ptrs) == len(sizes):
            return [_INVALID_PARAMS] * n
        tensors: list[Any] = []
        for p, sz in zip(ptrs, sizes, strict=True):
            m = _tensor.meta_at(p, sz) if p and self._registered(p, sz) else None
            ok = m is not None and m.data_offset + m.data_bytes == sz
            tensors.append(_tensor.tensor_from(ctypes.string_at(p, sz)) if ok else None)
        out = self._par_write(what, keys, [t if t is not None else object() for t in tensors],
                              parallelisms, writers, config, upsert)
        return [_INVALID_PARAMS if t is None else c
                for t, c in zip(tensors, out, strict=True)]

    # -- the public forms --------------------------------------------------------------

    def put_tensor_with_parallelism(self, key: str, tensor: Any, parallelism: Any = None,
                                    config: ReplicateConfig | None = None,
                                    writer_partition: Any = None) -> int:
        """0, or Mooncake's error code (-600 for an invalid layout request)."""
        return self._par_one(key, tensor, parallelism, writer_partition, config, False)

    def upsert_tensor_with_parallelism(self, key: str, tensor: Any, parallelism: Any = None,
                                       config: ReplicateConfig | None = None,
                                       writer_partition: Any = None) -> int:
        return self._par_one(key, tensor, parallelism, writer_partition, config, True)

    def batch_put_tensor_with_parallelism(
            self, keys: Sequence[str], tensors_list: Sequence[Any], parallelisms: Any = None,
            config: ReplicateConfig | None = None, writer_partitions: Any = None) -> list[int]:
        return self._par_write("batch_put_tensor_with_parallelism", keys, tensors_list,
                               parallelisms, writer_partitions, config, False)

    def batch_upsert_tensor_with_parallelism(
            self, keys: Sequence[str], tensors_list: Sequence[Any], parallelisms: Any = None,
            config: ReplicateConfig | None = None, writer_partitions: Any = None) -> list[int]:
        return self._par_write("batch_upsert_tensor_with_parallelism", keys, tensors_list,
                               parallelisms, writer_partitions, config, True)

    def put_tensor_with_parallelism_from(
            self, key: str, buffer_ptr: int, size: int, parallelism: Any = None,
            config: ReplicateConfig | None = None, writer_partition: Any = None) -> int:
        return self._par_from("put_tensor_with_parallelism_from", [key], [buffer_ptr],
                              [size], [parallelism], [writer_partition], config, False)[0]

    def upsert_tensor_with_parallelism_from(
            self, key: str, buffer_ptr: int, size: int, parallelism: Any = None,
            config: ReplicateConfig | None = None, writer_partition: Any = None) -> int:
        return self._par_from("upsert_tensor_with_parallelism_from", [key], [buffer_ptr],
                              [size], [parallelism], [writer_partition], config, True)[0]

    def batch_put_tensor_with_parallelism_from(
            self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int],
            parallelisms: Any = None, config: ReplicateConfig | None = None,
            writer_partitions: Any = None) -> list[int]:
        return self._par_from("batch_put_tensor_with_parallelism_from", keys, buffer_ptrs,
                              sizes, parallelisms, writer_partitions, config, False)

    def batch_upsert_tensor_with_parallelism_from(
            self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int],
            parallelisms: Any = None, config: ReplicateConfig | None = None,
            writer_partitions: Any = None) -> list[int]:
        return self._par_from("batch_upsert_tensor_with_parallelism_from", keys,
                              buffer_ptrs, sizes, parallelisms, writer_partitions, config,
                              True)
