"""The unified-parallelism tensor methods of ``MooncakeDistributedStore``
(``put_tensor_with_parallelism`` and its batch / ``_from`` / upsert forms,
``get_tensor_with_parallelism`` and its batch / ``_into`` forms), for a **full object**
only: with ``parallelism=None`` and ``writer_partition=None`` a put stores the whole tensor
under ``key`` (Mooncake's direct full-object route) and a read with ``target=None`` returns
the object as stored. Layout axes (``ParallelAxis``/``TensorParallelism``/``ReadTarget``)
and writer partitions are not provided: such a request answers -1012 (NOT_SUPPORTED) for a
put and None for a read, and says so in the log."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from pymooncake.store.compat._types import ReplicateConfig

NOT_SUPPORTED = -1012
_INVALID_PARAMS = -600
logger = logging.getLogger(__name__)


def _plain(what: str, *specs: Any) -> bool:
    """Whether every spec is absent (None, or a list of Nones); logs why not."""
    for spec in specs:
        items = spec if isinstance(spec, list | tuple) else [spec]
        if any(x is not None for x in items):
            logger.error("%s: layout axes and writer partitions are not supported by "
                         "pymooncake (only full objects: parallelism=None)", what)
            return False
    return True


class TensorParallelMethods:
    """Mixed into ``MooncakeDistributedStore``; uses its tensor methods."""

    _tensor_write: Any
    _tensor_from: Any
    get_tensor: Any
    batch_get_tensor: Any
    get_tensor_into: Any
    batch_get_tensor_into: Any

    def _par_write(self, keys: Sequence[str], tensors: Sequence[Any], config: Any,
                   upsert: bool, *specs: Any) -> list[int]:
        if not _plain("put_tensor_with_parallelism", *specs):
            return [NOT_SUPPORTED] * len(keys)
        return self._tensor_write(keys, tensors, config, upsert)

    def _par_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int],
                  config: Any, upsert: bool, *specs: Any) -> list[int]:
        if not _plain("put_tensor_with_parallelism_from", *specs):
            return [NOT_SUPPORTED] * len(keys)
        return self._tensor_from(keys, ptrs, sizes, upsert, config)

    def put_tensor_with_parallelism(self, key: str, tensor: Any, parallelism: Any = None,
                                    config: ReplicateConfig | None = None,
                                    writer_partition: Any = None) -> int:
        return self._par_write([key], [tensor], config, False, parallelism,
                               writer_partition)[0]

    def upsert_tensor_with_parallelism(self, key: str, tensor: Any, parallelism: Any = None,
                                       config: ReplicateConfig | None = None,
                                       writer_partition: Any = None) -> int:
        return self._par_write([key], [tensor], config, True, parallelism,
                               writer_partition)[0]

    def batch_put_tensor_with_parallelism(
            self, keys: Sequence[str], tensors_list: Sequence[Any], parallelisms: Any = None,
            config: ReplicateConfig | None = None, writer_partitions: Any = None) -> list[int]:
        return self._par_write(keys, tensors_list, config, False, parallelisms,
                               writer_partitions)

    def batch_upsert_tensor_with_parallelism(
            self, keys: Sequence[str], tensors_list: Sequence[Any], parallelisms: Any = None,
            config: ReplicateConfig | None = None, writer_partitions: Any = None) -> list[int]:
        return self._par_write(keys, tensors_list, config, True, parallelisms,
                               writer_partitions)

    def put_tensor_with_parallelism_from(
            self, key: str, buffer_ptr: int, size: int, parallelism: Any = None,
            config: ReplicateConfig | None = None, writer_partition: Any = None) -> int:
        return self._par_from([key], [buffer_ptr], [size], config, False, parallelism,
                              writer_partition)[0]

    def upsert_tensor_with_parallelism_from(
            self, key: str, buffer_ptr: int, size: int, parallelism: Any = None,
            config: ReplicateConfig | None = None, writer_partition: Any = None) -> int:
        return self._par_from([key], [buffer_ptr], [size], config, True, parallelism,
                              writer_partition)[0]

    def batch_put_tensor_with_parallelism_from(
            self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int],
            parallelisms: Any = None, config: ReplicateConfig | None = None,
            writer_partitions: Any = None) -> list[int]:
        return self._par_from(keys, buffer_ptrs, sizes, config, False, parallelisms,
                              writer_partitions)

    def batch_upsert_tensor_with_parallelism_from(
            self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int],
            parallelisms: Any = None, config: ReplicateConfig | None = None,
            writer_partitions: Any = None) -> list[int]:
        return self._par_from(keys, buffer_ptrs, sizes, config, True, parallelisms,
                              writer_partitions)

    def get_tensor_with_parallelism(self, key: str, target: Any = None) -> Any:
        return self.get_tensor(key) if _plain("get_tensor_with_parallelism", target) \
            else None

    def batch_get_tensor_with_parallelism(self, keys: Sequence[str], targets: Any = None
                                          ) -> list[Any]:
        if not _plain("batch_get_tensor_with_parallelism", targets):
            return [None] * len(keys)
        return self.batch_get_tensor(keys)

    def get_tensor_with_parallelism_into(self, key: str, buffer_ptr: int, size: int,
                                         target: Any = None) -> Any:
        if not _plain("get_tensor_with_parallelism_into", target):
            return None
        return self.get_tensor_into(key, buffer_ptr, size)

    def batch_get_tensor_with_parallelism_into(self, keys: Sequence[str],
                                               buffer_ptrs: Sequence[int],
                                               sizes: Sequence[int], targets: Any = None
                                               ) -> list[Any]:
        if not _plain("batch_get_tensor_with_parallelism_into", targets):
            return [None] * len(keys)
        return self.batch_get_tensor_into(keys, buffer_ptrs, sizes)
