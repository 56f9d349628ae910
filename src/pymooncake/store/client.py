"""``StoreClient``: Mooncake Store client = master RPCs + Transfer Engine data path.

A client may contribute a segment (``global_segment_size > 0``: a DRAM buffer registered
with the Transfer Engine and mounted on the master, optionally backed by an SSD tier) and
always has a local staging buffer (``local_buffer_size``) for ``put``/``get`` of Python
bytes. ``put_from``/``get_into`` move bytes straight between a registered user buffer and
the replicas (zero copy on this side).

Reads prefer a replica in this client's own segment, then the others in a shuffled order;
a failed replica read falls back to the next one, and when none is left the key is a miss
(``OBJECT_NOT_FOUND``) — never partial or corrupt bytes. A segment whose peer is down is
remembered as bad for ``bad_segment_ttl_s`` so later reads skip it at once (case BUG-34).
Every read path checks its read lease *after* the copy completes in one shared helper
(``_finish_read``): a read that outlived its lease reports ``LEASE_EXPIRED`` (case BUG-15).

Single-key methods raise ``StoreError``; batch methods return one entry per key, either
the value or a ``StoreError``. A background thread pings the master every
``heartbeat_interval_s`` and re-mounts the segment if the master forgot it (restart),
and serves the master's SSD orders for this client's segment.

A process runs one Transfer Engine: ``StoreClient(..., transfer_engine=te)`` uses a started
engine the caller owns (the worker's: its segment name becomes this client's segment name,
and ``close`` unregisters this client's buffers but leaves the engine running); without
one the client builds and owns its own.

The parts live by responsibility in ``client_master`` (master RPC, metadata-only ops),
``client_memory`` (segment, staging, registered buffers), ``client_put``, ``client_get``
(and ``client_ranges``: byte ranges of planned objects, for layer-wise KV loads)
and ``client_background`` (heartbeats, SSD orders, the SSD recovery at start);
``StoreClient`` joins them.

With an SSD tier the client is a *holder* (``SsdTier.holder()``, kept in its directory):
started again on the same directory it drops its previous life's segment at the master,
keeps the files that verify and re-registers them (``ssd_recover=False``: start empty,
the files are deleted), see ``store/master/recovery.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from pymooncake.rpc import RpcError, SyncRpcClient
from pymooncake.store.client_background import Background
from pymooncake.store.client_base import MAX_KEY_BYTES, parse_addr
from pymooncake.store.client_overlap import Location
from pymooncake.store.client_put import PutOps
from pymooncake.store.client_ranges import RangeGetOps
from pymooncake.store.datapath import DataPath
from pymooncake.store.errors import ErrorCode, StoreError
from pymooncake.store.leader import MasterLocator
from pymooncake.store.protocol import HeartbeatRequest, UnmountRequest
from pymooncake.store.tiers.dram_segment import OffsetAllocator
from pymooncake.store.tiers.ssd import SsdTier

__all__ = ["MAX_KEY_BYTES", "StoreClient", "parse_addr"]


CLOSE_UNMOUNT_S = 2.0
"""Longest ``StoreClient.close`` waits for the master (or a new leader) to unmount its
segment (seconds)."""

class StoreClient(Background, RangeGetOps, PutOps):
    """A Mooncake Store client (see module docstring).

    ``master``: ``"host:port"`` of ``pymooncake master``. ``metadata_url``: the Transfer
    Engine's metadata service (``http://h:p/metadata``, ``etcd://h:p``, ``embedded://``).
    Sizes in bytes. ``clock`` (seconds) is used for lease checks. Raises ``StoreError``
    from ``start()`` when the master cannot be reached or refuses the segment.
    ``transfer_engine``: a started ``TransferEngine`` to use instead of building one (its
    name is the segment name; ``name`` and ``transfer_config`` must then be left out).
    """

    def __init__(self, master: str, metadata_url: str, *, local_hostname: str = "127.0.0.1",
                 global_segment_size: int = 0, local_buffer_size: int = 16 << 20,
                 ssd_path: str | None = None, ssd_capacity: int = 0,
                 transfer_config: Any = None, clock: Callable[[], float] = time.monotonic,
                 heartbeat_interval_s: float = 1.0, rpc_timeout_s: float = 5.0,
                 bad_segment_ttl_s: float = 10.0, name: str | None = None,
                 transfer_engine: Any = None, ssd_recover: bool = True) -> None:
        # host:port, or an HA set (host:port,... or etcd://h:p[/cluster]) whose leader
        # every master call follows (store/leader.py)
        self.master_locator = MasterLocator(master)
        self.master_host, self.master_port = self.master_locator.first()
        for label, v in (("global_segment_size", global_segment_size),
                         ("local_buffer_size", local_buffer_size),
                         ("ssd_capacity", ssd_capacity)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{label}={v!r}: must be an int >= 0 (bytes)")
        if ssd_path and ssd_capacity <= 0:
            raise ValueError("ssd_path given without ssd_capacity > 0")
        if ssd_path and global_segment_size <= 0:
            raise ValueError("an SSD tier backs a segment: give global_segment_size > 0")
        if transfer_engine is not None:
            if transfer_config is not None:
                raise ValueError("transfer_config is the given transfer_engine's to set")
            if name is not None and name != transfer_engine.name:
                raise ValueError(f"name={name!r}: the segment is the transfer engine's "
                                 f"({transfer_engine.name!r})")
            name = transfer_engine.name
        self._engine = transfer_engine
        self.local_hostname = local_hostname
        self.metadata_url = metadata_url
        self.global_segment_size = global_segment_size
        self.local_buffer_size = local_buffer_size
        self.client_id = f"{local_hostname}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.segment_name = name or f"{local_hostname}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self._clock = clock
        self._hb_interval = heartbeat_interval_s
        self._rpc_timeout = rpc_timeout_s
        self._bad_ttl = bad_segment_ttl_s
        self._bad: dict[str, float] = {}
        self._owners: dict[str, tuple[int, str]] = {}  # segment → (owner pid, host id)
        self._owner_futs: dict[str, Any] = {}  # segment → lookup in flight
        from pymooncake.transfer.segment import local_host_id

        self._host_id = local_host_id()
        self._transfer_config = transfer_config
        self._ssd_path, self._ssd_capacity = ssd_path, ssd_capacity
        self._ssd_recover = ssd_recover
        self.ssd: SsdTier | None = None
        self.holder = ""  # the SSD directory's holder id (issue 17: rejoin)
        self.recovery: dict[str, Any] | None = None
        self._ssd_ready = threading.Event()  # set once the start-up SSD recovery is over
        """What the start-up SSD recovery did (``registered``, ``refused``, ``skipped``
        entries with reasons, ``removed_bad`` files); ``None`` without an SSD tier."""
        self._rpc_local = threading.local()  # one master connection per calling thread
        self._rpcs: list[SyncRpcClient] = []
        self._rng = random.Random()
        self._lock = threading.Lock()
        self._dp: DataPath | None = None
        self._segment_buf: Any = None
        self._segment_arr: np.ndarray | None = None
        self.segment_base = 0
        self._staging_arr: np.ndarray | None = None
        self._staging_base = 0
        self._staging: OffsetAllocator | None = None
        self._overflow: tuple[np.ndarray, int] | None = None  # (buffer, address)
        self._overflow_busy = False
        self._registered: dict[int, tuple[int, Any]] = {}  # addr → (bytes, keepalive)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._rpc_port = 0
        self._locations: dict[str, Location] = {}  # objects' places (client_overlap)
        self.started = False

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> StoreClient:
        """Start the Transfer Engine, register buffers, mount the segment. On any failure
        everything started so far is stopped again and the error is raised
        (``StoreError(RPC_FAIL)`` when the master or the metadata service cannot be
        reached or does not answer within ``rpc_timeout_s`` / the Transfer Engine's
        ``metadata_timeout_s``)."""
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        try:
            self._dp = DataPath(self.segment_name, self.metadata_url, self._transfer_config,
                                engine=self._engine)
        except (ValueError, TypeError):
            raise
        except Exception as e:  # metadata service unreachable/silent, engine refused
            why = str(e) or type(e).__name__
            if isinstance(e, TimeoutError):
                why = "no answer in time"
            raise StoreError(ErrorCode.RPC_FAIL, f"Transfer Engine did not start on "
                             f"metadata {self.metadata_url}: {why}") from None
        if self.local_buffer_size:
            self._staging_arr = np.zeros(self.local_buffer_size, dtype=np.uint8)
            self._staging_arr[::4096] = 0  # fault the pages in now, not on the first put
            self._staging_base = self._dp.register(self._staging_arr)
            self._staging = OffsetAllocator(self.local_buffer_size)
        if self.global_segment_size:
            self._segment_buf, self._segment_arr = self._alloc_segment(self.global_segment_size)
            self._segment_arr[::4096] = 0  # commit the pages now (Mooncake allocates up front)
            self.segment_base = self._dp.register(self._segment_buf)
            if self._ssd_path:
                # its own subdirectory of the path, locked: processes given the same
                # --ssd-path never touch each other's files (case BUG-29); a restart
                # finds its previous life's verified files (issue 17), unless told not to
                self.ssd = SsdTier.claim(self._ssd_path, self._ssd_capacity,
                                         recover=self._ssd_recover, drop_bad=True)
                self.holder = self.ssd.holder()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._bg_main, args=(ready,), daemon=True,
                                        name=f"store-client-{self.client_id}")
        self._thread.start()
        if not ready.wait(10.0):
            raise StoreError(ErrorCode.INTERNAL_ERROR, "client background thread did not start")
        self._dp.owner_dead = self._owner_dead
        self._dp.owner_prefetch = self._owner_prefetch
        self._master("heartbeat", HeartbeatRequest(self.client_id))
        if self.global_segment_size:
            self._mount()
            if self.ssd is not None:
                try:
                    self.recovery = self._recover_ssd()
                finally:
                    self._ssd_ready.set()
        self.started = True

    def close(self) -> None:
        """Unmount the segment (its objects' replicas there are dropped) and stop. The
        unmount is best effort, bounded by ``CLOSE_UNMOUNT_S``: with no master answering,
        the master's client TTL drops the segment later, and closing does not wait for a
        leader that may never come."""
        if self.started and self.global_segment_size:
            with contextlib.suppress(RpcError):
                self._rpc.call("unmount_segment", UnmountRequest(self.client_id,
                                                                 self.segment_name),
                               timeout_s=CLOSE_UNMOUNT_S, failover_s=CLOSE_UNMOUNT_S)
        self.started = False
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
        for rpc in list(self._rpcs):
            rpc.close()
        if self._dp is not None:
            with contextlib.suppress(Exception):
                self._dp.close()
            self._dp = None
        if self._segment_buf is not None and hasattr(self._segment_buf, "close"):
            self._segment_arr = None
            with contextlib.suppress(Exception):
                self._segment_buf.close()
            self._segment_buf = None
        if self.ssd is not None:
            self.ssd.close()

    def __enter__(self) -> StoreClient:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
