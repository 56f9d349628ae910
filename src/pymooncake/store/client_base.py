"""What every part of the Store client shares: constants, metrics, address parsing and
the ``ClientBase`` attribute declarations the ``client_*`` mixins work on (the state
itself is set up by ``StoreClient.__init__``)."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from pymooncake.obs import metrics
from pymooncake.store.config import ReplicateConfig
from pymooncake.store.errors import ErrorCode, StoreError

if TYPE_CHECKING:
    from pymooncake.rpc import SyncRpcClient
    from pymooncake.store.client_overlap import Location
    from pymooncake.store.datapath import DataPath
    from pymooncake.store.tiers.dram_segment import OffsetAllocator
    from pymooncake.store.tiers.ssd import SsdTier

M_OP_LATENCY = metrics.histogram("pymooncake_store_client_op_seconds",
                                 "Store client operation latency (s), by op", ["op"])
M_GETS = metrics.counter("pymooncake_store_client_gets_total",
                         "Store client gets, by result (hit/miss/error)", ["result"])
PUT_LATENCY = M_OP_LATENCY.labels("put")
GET_LATENCY = M_OP_LATENCY.labels("get")
GET_RESULT = {r: M_GETS.labels(r) for r in ("hit", "miss", "error")}

MAX_KEY_BYTES = 4096
DEFAULT_CONFIG = ReplicateConfig()

LOCAL_DONE = StoreError(ErrorCode.OK, "served from the local segment")
"""Marks a read already served by a memcpy from this client's own segment."""
NEEDS_LOAD = StoreError(ErrorCode.NO_AVAILABLE_HANDLE, "held only on SSD: load it first")
"""Marks a key ``batch_get`` loads back from SSD in a later round."""
LOAD_CHUNK = 16
"""Keys a ``batch_get`` round asks the master to load from SSD at once."""


def parse_addr(addr: str) -> tuple[str, int]:
    """``"host:port"`` → (host, port); raises ``ValueError`` naming the bad part."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {addr!r}: expected host:port")
    return host, int(port)


class ClientBase:
    """Attributes of a ``StoreClient`` (set in its ``__init__``/``start``)."""

    client_id: str
    segment_name: str
    local_hostname: str
    metadata_url: str
    master_host: str
    master_port: int
    global_segment_size: int
    local_buffer_size: int
    segment_base: int
    started: bool
    ssd: SsdTier | None
    _clock: Callable[[], float]
    _hb_interval: float
    _rpc_timeout: float
    _bad_ttl: float
    _bad: dict[str, float]
    _owners: dict[str, tuple[int, str]]
    _owner_futs: dict[str, Any]
    _host_id: str
    _ssd_capacity: int
    _rpc_local: threading.local
    _rpcs: list[SyncRpcClient]
    _rng: random.Random
    _lock: threading.Lock
    _dp: DataPath | None
    _segment_buf: Any
    _segment_arr: np.ndarray | None
    _staging_arr: np.ndarray | None
    _staging_base: int
    _staging: OffsetAllocator | None
    _overflow: tuple[np.ndarray, int] | None
    _overflow_busy: bool
    _registered: dict[int, tuple[int, Any]]
    _loop: asyncio.AbstractEventLoop | None
    _stop: asyncio.Event | None
    _rpc_port: int
    _locations: dict[str, Location]

    def _started_dp(self, what: str) -> DataPath:
        """The data path, or ``StoreError(INVALID_PARAMS)`` naming ``what`` when this client
        was never started or was closed (refused before the master sees the call)."""
        dp = self._dp
        if dp is None:
            raise StoreError(ErrorCode.INVALID_PARAMS, f"{what}: this StoreClient is not "
                             "started (call start() first) or was closed")
        return dp
