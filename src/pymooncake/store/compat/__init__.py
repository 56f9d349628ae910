"""``MooncakeDistributedStore``: Mooncake's Python store class, on pymooncake.

Method names, argument order and return conventions follow Mooncake's
``mooncake.store.MooncakeDistributedStore`` (wheel ``mooncake-transfer-engine-non-cuda``
0.3.13.post1; ../shared/MOONCAKE.md "Store"): ints are Mooncake's ``ErrorCode`` numbers
(0 = OK, negative = error), ``get`` returns ``b''`` for a missing key, ``is_exist`` returns
1/0/-1. Code written against Mooncake runs unchanged. Every place where pymooncake behaves
differently, and the methods not provided, are listed in docs/store.md ("Differences from
Mooncake") and docs/compat.md. tests/store/compat_api_scenario.py runs the same calls against both.
"""

from pymooncake.store.compat._async import MooncakeDistributedStoreAsync
from pymooncake.store.compat._buffer_pool import BufferPool
from pymooncake.store.compat._parallel_spec import ParallelAxis, ReadTarget, TensorParallelism
from pymooncake.store.compat._segments import bind_to_numa_node
from pymooncake.store.compat._store import MooncakeDistributedStore
from pymooncake.store.compat._tasks import QueryTaskResponse
from pymooncake.store.compat._types import (
    BufferHandle,
    Descriptor,
    DiskDescriptor,
    MemoryDescriptor,
    ObjectDataType,
    ReplicaDescriptor,
    ReplicaStatus,
    ReplicateConfig,
    SoftPinAction,
    TaskStatus,
    TaskType,
)

__all__ = ["BufferHandle", "BufferPool", "Descriptor", "DiskDescriptor", "MemoryDescriptor",
           "MooncakeDistributedStore", "MooncakeDistributedStoreAsync", "ObjectDataType",
           "ParallelAxis", "QueryTaskResponse", "ReadTarget", "ReplicaDescriptor",
           "ReplicaStatus", "ReplicateConfig", "SoftPinAction", "TaskStatus", "TaskType",
           "TensorParallelism", "bind_to_numa_node"]

# pybind11's ``export_values()``: each enum's members are also module attributes, in
# store_py.cpp's order (a later enum wins a shared name: ``PROCESSING`` is TaskStatus's)
_EXPORTED: dict[str, object] = {}
for _enum in (ObjectDataType, ReplicaStatus, TaskType, TaskStatus):
    _EXPORTED.update(_enum.__members__)
globals().update(_EXPORTED)
__all__ += sorted(_EXPORTED)
