"""The tensor methods of ``MooncakeDistributedStore`` (put/pub/upsert, batch, ``_from`` and
``_into`` forms), over the store's byte methods and ``_tensor``'s serialisation (Mooncake's
304-byte ``TensorMetadata`` layout). Tensor-parallel forms live in ``_tensor_tp``."""

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
    batch_put_from: Any
    batch_upsert_from: Any
    batch_get_into: Any
    _registered: Any

    # -- put / pub / upsert of tensor objects ------------------------------------------

    def _tensor_write(self, keys: Sequence[str], tensors: Sequence[Any],
                      config: ReplicateConfig | None, upsert: bool) -> list[int]:
        if len(keys) != len(tensors):
            return [_INVALID_PARAMS] * len(keys)
        write = self.upsert if upsert else self.put
        out = []
        for k, t in zip(keys, tensors, strict=True):
            try:
                data = _tensor.tensor_bytes(t)
            except (TypeError, ValueError):
                out.append(_INVALID_PARAMS)
                continue
            out.append(write(k, data, config))
        return out

    def put_tensor(self, key: str, tensor: Any) -> int:
        return self._tensor_write([key], [tensor], None, False)[0]

    def pub_tensor(self, key: str, tensor: Any, config: ReplicateConfig | None = None) -> int:
        return self._tensor_write([key], [tensor], config, False)[0]

    def upsert_tensor(self, key: str, tensor: Any) -> int:
        return self._tensor_write([key], [tensor], None, True)[0]

    def upsert_pub_tensor(self, key: str, tensor: Any,
                          config: ReplicateConfig | None = None) -> int:
        return self._tensor_write([key], [tensor], config, True)[0]

    def batch_put_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any]) -> list[int]:
        return self._tensor_write(keys, tensors_list, None, False)

    def batch_pub_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any],
                         config: ReplicateConfig | None = None) -> list[int]:
        return self._tensor_write(keys, tensors_list, config, False)

    def batch_upsert_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any]
                            ) -> list[int]:
        return self._tensor_write(keys, tensors_list, None, True)

    def batch_upsert_pub_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any],
                                config: ReplicateConfig | None = None) -> list[int]:
        return self._tensor_write(keys, tensors_list, config, True)

    # -- zero-copy forms: [TensorMetadata][data] in registered memory ------------------

    def _tensor_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int],
                     upsert: bool, config: ReplicateConfig | None = None) -> list[int]:
        """-600 for a range outside registered memory or one that does not hold a valid
        tensor object of exactly ``size`` bytes (as Mooncake checks it)."""
        if not len(keys) == len(ptrs) == len(sizes):
            return [_INVALID_PARAMS] * len(keys)
        ok = [i for i, (p, n) in enumerate(zip(ptrs, sizes, strict=True))
              if self._registered(p, n) and (m := _tensor.meta_at(p, n)) is not None
              and m.data_offset + m.data_bytes == n]
        out = [_INVALID_PARAMS] * len(keys)
        write = self.batch_upsert_from if upsert else self.batch_put_from
        codes = write([keys[i] for i in ok], [ptrs[i] for i in ok],
                      [sizes[i] for i in ok], config) if ok else []
        for i, c in zip(ok, codes, strict=True):
            out[i] = c
        return out

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return self._tensor_from([key], [buffer_ptr], [size], False)[0]

    def batch_put_tensor_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                              sizes: Sequence[int]) -> list[int]:
        return self._tensor_from(keys, buffer_ptrs, sizes, False)

    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return self._tensor_from([key], [buffer_ptr], [size], True)[0]

    def batch_upsert_tensor_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                                 sizes: Sequence[int]) -> list[int]:
        return self._tensor_from(keys, buffer_ptrs, sizes, True)

    # -- reads -------------------------------------------------------------------------

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
        """A tensor viewing each buffer (None for a miss); -600 for every key when the
        lists differ in length or a pointer is 0."""
        if not len(keys) == len(buffer_ptrs) == len(sizes) or not all(buffer_ptrs):
            return [_INVALID_PARAMS] * len(keys)  # as Mooncake: codes, not tensors
        got = self.batch_get_into(keys, buffer_ptrs, sizes)
        return [_tensor.tensor_at(p, n) if n > 0 else None
                for p, n in zip(buffer_ptrs, got, strict=True)]

    # -- safetensors files -------------------------------------------------------------

    def save_tensor_to_safetensor(self, key: str, file_name: str | None = None) -> int:
        """Writes the tensor under ``key`` to a safetensors file (named ``key`` when no
        ``file_name``): 0, -1100 (FILE_NOT_FOUND) when the key holds no tensor, -600 when
        the file cannot be written."""
        from pymooncake.store.compat import _safetensors

        data = self.get(key)
        meta = _tensor.parse(data, len(data)) if data else None
        if meta is None:
            return _safetensors.FILE_NOT_FOUND
        try:
            _safetensors.save(file_name or key, key, meta,
                              memoryview(data)[meta.data_offset:][:meta.data_bytes])
        except OSError:
            return _INVALID_PARAMS
        return 0

    def load_tensor_from_safetensor(self, key: str | None = None, file_name: str = ""
                                    ) -> Any:
        """Puts the file's tensor named ``key`` (else its first tensor) under ``key`` (else
        ``file_name``) and returns it; None on any failure."""
        from pymooncake.store.compat import _safetensors

        try:
            entries = _safetensors.load(file_name)
        except (OSError, ValueError):
            return None
        if not entries:
            return None
        store_key = file_name if key is None else key
        name = store_key if store_key in entries else next(iter(entries))
        dtype, shape, raw = entries[name]
        meta = _tensor.Meta(dtype, shape, shape, _tensor.FULL, (), _tensor.METADATA_SIZE,
                            len(raw))
        if self.put(store_key, _tensor.metadata(dtype, shape, len(raw)) + raw) != 0:
            return None
        return _tensor.build(meta, bytearray(raw))
