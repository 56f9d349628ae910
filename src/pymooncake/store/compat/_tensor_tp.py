"""Tensor-parallel forms (``*_with_tp``) of ``MooncakeDistributedStore``, as Mooncake:
a put splits the *full* tensor along ``split_dim`` into ``tp_size`` equal chunks
(``tensor.chunk(tp_size, split_dim)``) and stores chunk ``r`` under ``f"{key}_tp_{r}"`` for
every rank — ``tp_rank`` is accepted and does not matter for a put; a get reads rank
``tp_rank``'s chunk. ``tp_size <= 1`` is the plain tensor call on ``key``. As Mooncake
0.3.13 (observed): a dimension not divisible by ``tp_size``, or a ``split_dim`` outside
``[0, ndim)`` (negative included), is -600. Chunks are SHARD objects with one TP layout
axis, byte-identical to Mooncake's."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from pymooncake.store.compat import _tensor
from pymooncake.store.compat._types import ReplicateConfig

_INVALID_PARAMS = -600


def tp_key(key: str, rank: int) -> str:
    return f"{key}_tp_{rank}"


def _shards(code: int, shape: tuple[int, ...], raw: Any, tp_size: int, split_dim: int
            ) -> list[bytes] | None:
    """Each rank's serialised chunk, or None when the split is impossible."""
    if not isinstance(split_dim, int) or not 0 <= split_dim < len(shape):
        return None
    dim = split_dim
    n = shape[dim]
    step = n // tp_size
    if step == 0 or n % tp_size:
        return None
    arr = np.frombuffer(raw, dtype=np.uint8).reshape(*shape[:dim], n, -1) if raw.nbytes \
        else None
    out = []
    for r in range(tp_size):
        lo, hi = r * step, min(n, (r + 1) * step)
        sub = shape[:dim] + (hi - lo,) + shape[dim + 1:]
        piece = np.ascontiguousarray(arr[..., lo:hi, :]).tobytes() if arr is not None else b""
        out.append(_tensor.metadata(code, sub, len(piece), global_shape=shape,
                                    kind=_tensor.SHARD,
                                    axes=((_tensor.AXIS_TP, r, tp_size, dim),)) + piece)
    return out


class TensorTpMethods:
    """Mixed into ``MooncakeDistributedStore``; uses its tensor and byte methods."""

    put: Any
    upsert: Any
    batch_put: Any
    put_tensor: Any
    pub_tensor: Any
    get_tensor: Any
    batch_get_tensor: Any
    get_tensor_into: Any
    batch_get_tensor_into: Any
    put_tensor_from: Any
    batch_put_tensor_from: Any
    _registered: Any

    def _tp_write(self, keys: Sequence[str], tensors: Sequence[Any], config: Any,
                  tp_size: int, split_dim: int) -> list[int]:
        if len(keys) != len(tensors):
            return [_INVALID_PARAMS] * len(keys)
        out = []
        for k, t in zip(keys, tensors, strict=True):
            try:
                code, shape, raw = _tensor.raw_of(t)
            except (TypeError, ValueError):
                out.append(_INVALID_PARAMS)
                continue
            out.append(self._tp_store(k, code, shape, raw, config, tp_size, split_dim))
        return out

    def _tp_store(self, key: str, code: int, shape: tuple[int, ...], raw: Any, config: Any,
                  tp_size: int, split_dim: int) -> int:
        shards = _shards(code, shape, raw, tp_size, split_dim) if shape else None
        if shards is None:
            return _INVALID_PARAMS
        codes = [self.put(tp_key(key, r), s, config) for r, s in enumerate(shards)]
        return next((c for c in codes if c), 0)

    def put_tensor_with_tp(self, key: str, tensor: Any, tp_rank: int = 0, tp_size: int = 1,
                           split_dim: int = 0) -> int:
        if tp_size <= 1:
            return self.put_tensor(key, tensor)
        return self._tp_write([key], [tensor], None, tp_size, split_dim)[0]

    def pub_tensor_with_tp(self, key: str, tensor: Any, config: ReplicateConfig | None = None,
                           tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> int:
        if tp_size <= 1:
            return self.pub_tensor(key, tensor, config)
        return self._tp_write([key], [tensor], config, tp_size, split_dim)[0]

    def batch_put_tensor_with_tp(self, base_keys: Sequence[str], tensors_list: Sequence[Any],
                                 tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
                                 ) -> list[int]:
        return self.batch_pub_tensor_with_tp(base_keys, tensors_list, None, tp_rank, tp_size,
                                             split_dim)

    def batch_pub_tensor_with_tp(self, base_keys: Sequence[str], tensors_list: Sequence[Any],
                                 config: ReplicateConfig | None = None, tp_rank: int = 0,
                                 tp_size: int = 1, split_dim: int = 0) -> list[int]:
        if tp_size <= 1:
            return [self.pub_tensor(k, t, config)
                    for k, t in zip(base_keys, tensors_list, strict=False)] if len(
                base_keys) == len(tensors_list) else [_INVALID_PARAMS] * len(base_keys)
        return self._tp_write(base_keys, tensors_list, config, tp_size, split_dim)

    def put_tensor_with_tp_from(self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0,
                                tp_size: int = 1, split_dim: int = 0) -> int:
        """The full tensor object at ``[buffer_ptr, +size)`` (registered memory), split and
        stored for every rank."""
        return self.batch_put_tensor_with_tp_from([key], [buffer_ptr], [size], tp_rank,
                                                  tp_size, split_dim)[0]

    def batch_put_tensor_with_tp_from(self, base_keys: Sequence[str],
                                      buffer_ptrs: Sequence[int], sizes: Sequence[int],
                                      tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
                                      ) -> list[int]:
        if tp_size <= 1:
            return self.batch_put_tensor_from(base_keys, buffer_ptrs, sizes)
        if not len(base_keys) == len(buffer_ptrs) == len(sizes):
            return [_INVALID_PARAMS] * len(base_keys)
        out = []
        for k, p, n in zip(base_keys, buffer_ptrs, sizes, strict=True):
            m = _tensor.meta_at(p, n) if self._registered(p, n) else None
            if m is None or m.kind != _tensor.FULL or m.data_offset + m.data_bytes != n:
                out.append(_INVALID_PARAMS)
                continue
            raw = memoryview(ctypes.string_at(p + m.data_offset, m.data_bytes))
            out.append(self._tp_store(k, m.dtype, m.local_shape, raw, None, tp_size,
                                      split_dim))
        return out

    def get_tensor_with_tp(self, key: str, tp_rank: int = 0, tp_size: int = 1,
                           split_dim: int = 0) -> Any:
        if tp_size <= 1:
            return self.get_tensor(key)
        return self.get_tensor(tp_key(key, tp_rank))

    def batch_get_tensor_with_tp(self, base_keys: Sequence[str], tp_rank: int = 0,
                                 tp_size: int = 1) -> list[Any]:
        if tp_size <= 1:
            return self.batch_get_tensor(base_keys)
        return self.batch_get_tensor([tp_key(k, tp_rank) for k in base_keys])

    def get_tensor_with_tp_into(self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0,
                                tp_size: int = 1, split_dim: int = 0) -> Any:
        k = key if tp_size <= 1 else tp_key(key, tp_rank)
        return self.get_tensor_into(k, buffer_ptr, size)

    def batch_get_tensor_with_tp_into(self, base_keys: Sequence[str],
                                      buffer_ptrs: Sequence[int], sizes: Sequence[int],
                                      tp_rank: int = 0, tp_size: int = 1) -> list[Any]:
        keys = list(base_keys) if tp_size <= 1 else [tp_key(k, tp_rank) for k in base_keys]
        return self.batch_get_tensor_into(keys, buffer_ptrs, sizes)
