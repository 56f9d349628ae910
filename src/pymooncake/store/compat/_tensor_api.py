"""The tensor methods of ``MooncakeDistributedStore`` (put/pub/upsert, batch, ``_from``
and ``_into`` forms), over the store's byte methods and ``_tensor``'s serialisation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pymooncake.store.compat import _tensor
from pymooncake.store.compat._types import ReplicateConfig

_INVALID_PARAMS = -600


class TensorMethods:
    """Mixed into ``MooncakeDistributedStore``; uses its put/upsert/get methods."""

    put: Any
    upsert: Any
    get: Any
    get_batch: Any
    put_from: Any
    upsert_from: Any
    batch_put_from: Any
    batch_upsert_from: Any
    batch_get_into: Any

    def put_tensor(self, key: str, tensor: Any) -> int:
        return self.pub_tensor(key, tensor)

    def pub_tensor(self, key: str, tensor: Any, config: ReplicateConfig | None = None) -> int:
        try:
            return self.put(key, _tensor.tensor_bytes(tensor), config)
        except (TypeError, ValueError):
            return _INVALID_PARAMS

    def upsert_tensor(self, key: str, tensor: Any) -> int:
        return self.upsert_pub_tensor(key, tensor)

    def upsert_pub_tensor(self, key: str, tensor: Any,
                          config: ReplicateConfig | None = None) -> int:
        try:
            return self.upsert(key, _tensor.tensor_bytes(tensor), config)
        except (TypeError, ValueError):
            return _INVALID_PARAMS

    def batch_put_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any]) -> list[int]:
        return self.batch_pub_tensor(keys, tensors_list)

    def batch_pub_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any],
                         config: ReplicateConfig | None = None) -> list[int]:
        if len(keys) != len(tensors_list):
            return [_INVALID_PARAMS] * len(keys)
        return [self.pub_tensor(k, t, config) for k, t in zip(keys, tensors_list, strict=True)]

    def batch_upsert_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any]
                            ) -> list[int]:
        return self.batch_upsert_pub_tensor(keys, tensors_list)

    def batch_upsert_pub_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any],
                                config: ReplicateConfig | None = None) -> list[int]:
        if len(keys) != len(tensors_list):
            return [_INVALID_PARAMS] * len(keys)
        return [self.upsert_pub_tensor(k, t, config)
                for k, t in zip(keys, tensors_list, strict=True)]

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """A tensor already serialised (as ``get_tensor_into`` leaves it) in registered
        memory."""
        return self.put_from(key, buffer_ptr, size)

    def batch_put_tensor_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                              sizes: Sequence[int]) -> list[int]:
        return self.batch_put_from(keys, buffer_ptrs, sizes)

    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return self.upsert_from(key, buffer_ptr, size)

    def batch_upsert_tensor_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                                 sizes: Sequence[int]) -> list[int]:
        return self.batch_upsert_from(keys, buffer_ptrs, sizes)

    def get_tensor(self, key: str) -> Any:
        """The tensor (torch when torch is loaded, else numpy), or None when missing."""
        data = self.get(key)
        return _tensor.tensor_from(data) if data else None

    def batch_get_tensor(self, keys: Sequence[str]) -> list[Any]:
        return [_tensor.tensor_from(d) if d else None for d in self.get_batch(keys)]

    def get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> Any:
        """Reads the serialised tensor into registered memory and returns a tensor viewing
        it (no copy), or None."""
        return self.batch_get_tensor_into([key], [buffer_ptr], [size])[0]

    def batch_get_tensor_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                              sizes: Sequence[int]) -> list[Any]:
        got = self.batch_get_into(keys, buffer_ptrs, sizes)
        return [_tensor.tensor_at(p, n) if n > 0 else None
                for p, n in zip(buffer_ptrs, got, strict=True)]
