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
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pymooncake.obs import metrics
from pymooncake.obs.logging import init_logger
from pymooncake.rpc import RpcClient, RpcError, RpcServer, SyncRpcClient, to_wire
from pymooncake.store.config import ReplicateConfig
from pymooncake.store.datapath import DataPath, Move
from pymooncake.store.errors import ErrorCode, StoreError
from pymooncake.store.leader import LeaderRpc, LeaderSyncRpc, MasterLocator
from pymooncake.store.master.core import validate_key
from pymooncake.store.protocol import (
    TIER_DRAM,
    BatchPutEndRequest,
    HeartbeatRequest,
    KeysRequest,
    LoadOrder,
    MountRequest,
    PutEndRequest,
    PutHandle,
    RemoveAllRequest,
    RemoveRequest,
    ReplicaDesc,
    ReplicaList,
    SpillOrder,
    UnmountRequest,
    put_handle_from_wire,
    replica_list_from_wire,
)
from pymooncake.store.tiers.dram_segment import OffsetAllocator
from pymooncake.store.tiers.ssd import SsdCorrupt, SsdFull, SsdTier

logger = init_logger(__name__)

M_OP_LATENCY = metrics.histogram("pymooncake_store_client_op_seconds",
                                 "Store client operation latency (s), by op", ["op"])
M_GETS = metrics.counter("pymooncake_store_client_gets_total",
                         "Store client gets, by result (hit/miss/error)", ["result"])

_LOCAL_DONE = StoreError(ErrorCode.OK, "served from the local segment")
"""Marks a read already served by a memcpy from this client's own segment."""
_NEEDS_LOAD = StoreError(ErrorCode.NO_AVAILABLE_HANDLE, "held only on SSD: load it first")
"""Marks a key ``batch_get`` loads back from SSD in a later round."""
_LOAD_CHUNK = 16
"""Keys a ``batch_get`` round asks the master to load from SSD at once."""
_PUT_LATENCY = M_OP_LATENCY.labels("put")
_GET_LATENCY = M_OP_LATENCY.labels("get")
_GET_RESULT = {r: M_GETS.labels(r) for r in ("hit", "miss", "error")}

MAX_KEY_BYTES = 4096
_DEFAULT_CONFIG = ReplicateConfig()


def parse_addr(addr: str) -> tuple[str, int]:
    """``"host:port"`` → (host, port); raises ``ValueError`` naming the bad part."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {addr!r}: expected host:port")
    return host, int(port)


class _ReadPlan:
    __slots__ = ("key", "size", "replicas", "lease_expiry", "error")

    def __init__(self, key: str) -> None:
        self.key = key
        self.size = 0
        self.replicas: list[ReplicaDesc] = []
        self.lease_expiry = 0.0
        self.error: StoreError | None = None


class StoreClient:
    """A Mooncake Store client (see module docstring).

    ``master``: ``"host:port"`` of ``pymooncake master``. ``metadata_url``: the Transfer
    Engine's metadata service (``http://h:p/metadata``, ``etcd://h:p``, ``embedded://``).
    Sizes in bytes. ``clock`` (seconds) is used for lease checks. Raises ``StoreError``
    from ``start()`` when the master cannot be reached or refuses the segment.
    """

    def __init__(self, master: str, metadata_url: str, *, local_hostname: str = "127.0.0.1",
                 global_segment_size: int = 0, local_buffer_size: int = 16 << 20,
                 ssd_path: str | None = None, ssd_capacity: int = 0,
                 transfer_config: Any = None, clock: Callable[[], float] = time.monotonic,
                 heartbeat_interval_s: float = 1.0, rpc_timeout_s: float = 5.0,
                 bad_segment_ttl_s: float = 10.0, name: str | None = None) -> None:
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
        from pymooncake.transfer.segment import local_host_id

        self._host_id = local_host_id()
        self._transfer_config = transfer_config
        self._ssd_path, self._ssd_capacity = ssd_path, ssd_capacity
        self.ssd: SsdTier | None = None
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
        self._registered: dict[int, tuple[int, Any]] = {}  # addr → (bytes, keepalive)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._rpc_port = 0
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
            self._dp = DataPath(self.segment_name, self.metadata_url, self._transfer_config)
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
                # --ssd-path never touch each other's files (case BUG-29)
                self.ssd = SsdTier.claim(self._ssd_path, self._ssd_capacity)
        ready = threading.Event()
        self._thread = threading.Thread(target=self._bg_main, args=(ready,), daemon=True,
                                        name=f"store-client-{self.client_id}")
        self._thread.start()
        if not ready.wait(10.0):
            raise StoreError(ErrorCode.INTERNAL_ERROR, "client background thread did not start")
        self._dp.owner_dead = self._owner_dead
        self._master("heartbeat", HeartbeatRequest(self.client_id))
        if self.global_segment_size:
            self._mount()
        self.started = True

    @staticmethod
    def _alloc_segment(size: int) -> tuple[Any, np.ndarray]:
        """Shared memory when the transfer layer offers it (same-host peers map it)."""
        try:
            from pymooncake.transfer.memory import SharedBuffer

            buf = SharedBuffer(size)
            return buf, np.frombuffer(buf.view(), dtype=np.uint8)
        except Exception:  # no /dev/shm: private memory, reached over tcp
            arr = np.zeros(size, dtype=np.uint8)
            return arr, arr

    def _owner_dead(self, segment: str) -> str | None:
        """Liveness check of ``segment``'s owner after a successful move (case BUG-34):
        why it is dead, or ``None`` (alive, on another host, or unknown). Same host only:
        the owner's pid (from its Transfer Engine descriptor, looked up once per segment)
        must exist; a dead owner's shm mapping still holds bytes, but a dead segment's
        replicas must not be relied on before the master drops them at ``client_ttl``.
        Assumes one pid namespace per host id (as the shm transport itself does)."""
        owner = self._owners.get(segment)
        if owner is None:
            if self._loop is None or self._dp is None:
                return None
            owner = self._dp.lookup_owner(segment, self._loop, self._rpc_timeout)
            if owner is None:
                return None
            self._owners[segment] = owner
        pid, host_id = owner
        if pid <= 0 or host_id != self._host_id or pid == os.getpid():
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            self._owners.pop(segment, None)  # a new owner may publish the name again
            return f"owner pid {pid} of segment {segment!r} is dead"
        except PermissionError:
            pass  # exists, owned by another user
        return None

    def _mount(self) -> None:
        self._master("mount_segment", MountRequest(
            self.client_id, self.segment_name, self.local_hostname, self.segment_base,
            self.global_segment_size, self._ssd_capacity if self.ssd else 0,
            self.local_hostname, self._rpc_port))

    def close(self) -> None:
        """Unmount the segment (its objects' replicas there are dropped) and stop."""
        if self.started and self.global_segment_size:
            with contextlib.suppress(StoreError):
                self._master("unmount_segment", UnmountRequest(self.client_id,
                                                               self.segment_name))
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

    # -- background thread: heartbeats + SSD orders ------------------------------------

    def _bg_main(self, ready: threading.Event) -> None:
        asyncio.run(self._bg(ready))

    async def _bg(self, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = None
        if self.global_segment_size:
            server = RpcServer("127.0.0.1" if self.local_hostname in ("localhost",)
                               else self.local_hostname, 0)
            server.register("ssd_spill", self._ssd_spill, SpillOrder)
            server.register("ssd_load", self._ssd_load, LoadOrder)
            server.register("ssd_delete", self._ssd_delete)
            await server.start()
            self._rpc_port = server.port
        master = LeaderRpc(self.master_locator, self._rpc_timeout)
        ready.set()
        try:
            while not self._stop.is_set():
                with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self._hb_interval)
                if self._stop.is_set() or not self.started:
                    continue
                try:
                    res = await master.call("heartbeat", HeartbeatRequest(self.client_id))
                    if not res.get("known", True) and self.global_segment_size:
                        await self._remount(master)
                except RpcError as e:
                    logger.debug("heartbeat failed: %s", e)
        finally:
            with contextlib.suppress(Exception):
                await master.close()
            if server is not None:
                await server.stop()

    async def _remount(self, master: RpcClient) -> None:
        """The master forgot us (restart without snapshot): its objects are gone, so our
        segment's bytes and SSD files are free space; mount again (case BUG-31)."""
        if self.ssd is not None:
            await asyncio.to_thread(self.ssd.clear)
        logger.info("master forgot client %s; re-mounting %s", self.client_id,
                    self.segment_name)
        await master.call("mount_segment", MountRequest(
            self.client_id, self.segment_name, self.local_hostname, self.segment_base,
            self.global_segment_size, self._ssd_capacity if self.ssd else 0,
            self.local_hostname, self._rpc_port))

    def _seg_view(self, addr: int, length: int) -> np.ndarray:
        off = addr - self.segment_base
        if self._segment_arr is None or off < 0 or off + length > self.global_segment_size:
            raise RpcError("INVALID_PARAMS", f"range {addr}+{length} outside this segment")
        return self._segment_arr[off:off + length]

    async def _ssd_spill(self, order: SpillOrder) -> dict[str, Any]:
        if self.ssd is None:
            return {"ok": False, "dropped": []}
        data = self._seg_view(order.addr, order.length).tobytes()
        try:
            dropped = await self.ssd.aput(order.key, data)
        except (SsdFull, OSError) as e:
            logger.warning("spill of %r failed: %s", order.key, e)
            return {"ok": False, "dropped": []}
        return {"ok": True, "dropped": dropped}

    async def _ssd_load(self, order: LoadOrder) -> dict[str, Any]:
        if self.ssd is None:
            return {"ok": False}
        try:
            data = await self.ssd.aget(order.key)
        except SsdCorrupt as e:  # never hand damaged bytes on (case BUG-60)
            logger.warning("SSD copy of %r is corrupt, dropped: %s", order.key, e)
            return {"ok": False, "corrupt": True}
        if data is None or len(data) != order.length:
            return {"ok": False}
        self._seg_view(order.addr, order.length)[:] = np.frombuffer(data, dtype=np.uint8)
        return {"ok": True}

    async def _ssd_delete(self, params: dict[str, Any]) -> int:
        if self.ssd is None:
            return 0
        n = 0
        for key in params.get("keys", []):
            n += await self.ssd.aremove(str(key))
        return n

    # -- master RPC --------------------------------------------------------------------

    @property
    def _rpc(self) -> SyncRpcClient:
        """This thread's connection to the master (threads do not queue behind each other)."""
        rpc = getattr(self._rpc_local, "rpc", None)
        if rpc is None:
            rpc = LeaderSyncRpc(self.master_locator, self._rpc_timeout)
            self._rpc_local.rpc = rpc
            with self._lock:
                self._rpcs.append(rpc)
        return rpc

    def _master(self, method: str, params: Any) -> Any:
        try:
            return self._rpc.call(method, params)
        except RpcError as e:
            raise StoreError.from_rpc(e) from None

    @staticmethod
    def _batch_item(item: dict[str, Any]) -> Any:
        if "e" in item:
            code, msg = item["e"]
            return StoreError(ErrorCode(code), msg)
        return item.get("r")

    # -- memory ------------------------------------------------------------------------

    def register_buffer(self, buffer: object) -> int:
        """Register a user buffer for ``put_from``/``get_into``; returns its base address.
        Raises ``StoreError(INVALID_PARAMS)`` for a non-contiguous or overlapping buffer."""
        from pymooncake.transfer.memory import buffer_address

        assert self._dp is not None
        try:
            _, nbytes, keep = buffer_address(buffer)
            addr = self._dp.register(buffer)
        except (ValueError, TypeError) as e:
            raise StoreError(ErrorCode.INVALID_PARAMS, f"cannot register buffer: {e}") from None
        self._registered[addr] = (nbytes, keep)
        return addr

    def register_memory(self, addr: int, size: int) -> int:
        """Register raw memory ``[addr, addr+size)`` that the caller keeps alive."""
        assert self._dp is not None
        if not isinstance(addr, int) or not isinstance(size, int) or addr <= 0 or size <= 0:
            raise StoreError(ErrorCode.INVALID_PARAMS,
                             f"register_memory({addr!r}, {size!r}): need addr > 0, size > 0")
        try:
            self._dp.register_at(addr, size)
        except (ValueError, TypeError) as e:
            raise StoreError(ErrorCode.INVALID_PARAMS, f"cannot register memory: {e}") from None
        self._registered[addr] = (size, None)
        return addr

    def unregister_buffer(self, addr: int) -> None:
        if addr not in self._registered:
            raise StoreError(ErrorCode.INVALID_PARAMS, f"address {addr:#x} is not registered")
        assert self._dp is not None
        self._dp.unregister(addr)
        del self._registered[addr]

    def _stage(self, size: int) -> tuple[int, np.ndarray, Callable[[], None]]:
        """A registered local range of ``size`` bytes: (addr, view, release)."""
        assert self._dp is not None
        if self._staging is not None:
            with self._lock:
                off = self._staging.allocate(size) if size <= self.local_buffer_size else None
            if off is not None:
                assert self._staging_arr is not None

                def release(off: int = off) -> None:
                    with self._lock:
                        assert self._staging is not None
                        self._staging.free(off)

                return (self._staging_base + off, self._staging_arr[off:off + size], release)
        arr = np.empty(max(size, 1), dtype=np.uint8)  # oversize or busy: a one-off buffer
        addr = self._dp.register(arr)
        dp = self._dp
        return addr, arr[:size], lambda: dp.unregister(addr)

    # -- put ---------------------------------------------------------------------------

    @staticmethod
    def _check_key(key: object) -> str:
        return validate_key(key, MAX_KEY_BYTES)

    @staticmethod
    def _as_bytes(value: object) -> memoryview:
        if isinstance(value, bytes | bytearray | memoryview):
            mv = memoryview(value)
            return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
        if isinstance(value, np.ndarray) and value.flags.c_contiguous:
            return memoryview(value).cast("B")
        raise StoreError(ErrorCode.INVALID_PARAMS,
                         f"value must be bytes-like, got {type(value).__name__}")

    def put(self, key: str, value: bytes | bytearray | memoryview,
            config: ReplicateConfig | None = None) -> None:
        """Store ``value`` under ``key`` (two-phase). Raises ``StoreError``:
        ``OBJECT_ALREADY_EXISTS`` if present, ``NO_AVAILABLE_HANDLE`` when full,
        ``INVALID_KEY``/``INVALID_PARAMS`` for bad input (nothing stored)."""
        (err,) = self.batch_put([key], [value], config)
        if err is not None:
            raise err

    def batch_put(self, keys: Sequence[str], values: Sequence[Any],
                  config: ReplicateConfig | None = None) -> list[StoreError | None]:
        """Put many; one ``None`` (stored) or ``StoreError`` per key."""
        t0 = time.perf_counter()
        if len(keys) != len(values):
            raise StoreError(ErrorCode.INVALID_PARAMS, "keys and values differ in length")
        out: list[StoreError | None] = [None] * len(keys)
        views: list[memoryview | None] = []
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            try:
                self._check_key(k)
                mv = self._as_bytes(v)
                if mv.nbytes == 0:
                    raise StoreError(ErrorCode.INVALID_PARAMS, "empty value")
                views.append(mv)
            except StoreError as e:
                out[i] = e
                views.append(None)
        self._put(list(keys), views, [(v.nbytes if v is not None else 0) for v in views],
                  config, out)
        _PUT_LATENCY.observe(time.perf_counter() - t0)
        return out

    def put_from(self, key: str, addr: int, size: int,
                 config: ReplicateConfig | None = None) -> None:
        """Store ``size`` bytes at ``addr`` of a registered buffer (zero copy here)."""
        (err,) = self.batch_put_from([key], [addr], [size], config)
        if err is not None:
            raise err

    def batch_put_from(self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int],
                       config: ReplicateConfig | None = None) -> list[StoreError | None]:
        if not len(keys) == len(addrs) == len(sizes):
            raise StoreError(ErrorCode.INVALID_PARAMS, "keys, addrs and sizes differ in length")
        out: list[StoreError | None] = [None] * len(keys)
        for i, (k, a, s) in enumerate(zip(keys, addrs, sizes, strict=True)):
            try:
                self._check_key(k)
                if not isinstance(s, int) or s <= 0:
                    raise StoreError(ErrorCode.INVALID_PARAMS, f"size={s!r}: must be > 0")
                if not self._in_registered(a, s):
                    raise StoreError(ErrorCode.INVALID_PARAMS,
                                     f"[{a:#x}, +{s}) is not inside a registered buffer")
            except StoreError as e:
                out[i] = e
        self._put(list(keys), list(addrs),
                  [s if out[i] is None else 0 for i, s in enumerate(sizes)], config, out)
        return out

    def _in_registered(self, addr: int, size: int) -> bool:
        return any(base <= addr and addr + size <= base + n
                   for base, (n, _) in self._registered.items())

    def _local_view(self, addr: int, length: int) -> np.ndarray | None:
        """A view of ``[addr, addr+length)`` when it lies in this client's own segment."""
        off = addr - self.segment_base
        if self._segment_arr is None or off < 0 or off + length > self.global_segment_size:
            return None
        return self._segment_arr[off:off + length]

    def _put(self, keys: list[str], sources: list[Any], sizes: list[int],
             config: ReplicateConfig | None, out: list[StoreError | None]) -> None:
        """Two-phase put of ``sources[i]``: a registered address (``put_from``) or a
        bytes view (``put``). Replicas in this process's own segment are filled by one
        memcpy (as Mooncake does for local replicas); every other replica is written by the
        Transfer Engine, from a staging copy for bytes views."""
        idx = [i for i in range(len(keys)) if out[i] is None]
        if not idx:
            return
        req: dict[str, Any] = {"client_id": self.client_id, "keys": [keys[i] for i in idx],
                               "sizes_bytes": [sizes[i] for i in idx]}
        if config is not None and config != _DEFAULT_CONFIG:
            req["config"] = to_wire(config)
        res = self._master("batch_put_start", req)
        handles: dict[int, dict[str, Any]] = {}
        for i, item in zip(idx, res, strict=True):
            r = self._batch_item(item)
            if isinstance(r, StoreError):
                out[i] = r
            else:
                handles[i] = r
        moves, owners = [], []
        staged: list[Callable[[], None]] = []
        try:
            for i, h in handles.items():
                src = sources[i]
                src_addr = src if isinstance(src, int) else None
                for rep in h["replicas"]:  # [replica_id, segment, addr, length, ...]
                    local = (self._local_view(rep[2], sizes[i])
                             if rep[1] == self.segment_name else None)
                    if local is not None and src_addr is None:
                        local[:] = np.frombuffer(src, dtype=np.uint8)
                        continue
                    if src_addr is None:
                        src_addr, arr, release = self._stage(sizes[i])
                        arr[:] = np.frombuffer(src, dtype=np.uint8)
                        staged.append(release)
                    moves.append(Move(True, src_addr, rep[1], rep[2], sizes[i]))
                    owners.append(i)
            assert self._dp is not None
            results = self._dp.run(moves)
        finally:
            for release in staged:
                release()
        failed: dict[int, str] = {}
        for i, r in zip(owners, results, strict=True):
            if not r.ok:
                failed.setdefault(i, r.reason)
        ok = [i for i in handles if i not in failed]
        if failed:
            self._master("batch_put_revoke", BatchPutEndRequest(
                self.client_id, tuple(keys[i] for i in failed),
                tuple(handles[i]["generation"] for i in failed)))
            for i, reason in failed.items():
                out[i] = StoreError(ErrorCode.TRANSFER_FAIL, f"write of {keys[i]!r}: {reason}")
        if ok:
            res = self._master("batch_put_end", {
                "client_id": self.client_id, "keys": [keys[i] for i in ok],
                "generations": [handles[i]["generation"] for i in ok]})
            for i, item in zip(ok, res, strict=True):
                r = self._batch_item(item)
                if isinstance(r, StoreError):
                    out[i] = r

    # -- get ---------------------------------------------------------------------------

    def _plan(self, keys: Sequence[str], prefer_local: bool, load: bool = True
              ) -> list[_ReadPlan]:
        """Replica lists (and leases) for ``keys``. ``load=False``: a key held only on SSD
        is not loaded here but marked ``_NEEDS_LOAD`` (``batch_get`` loads it in a later
        round, after the DRAM-resident keys were read and gave their leases back)."""
        plans = [_ReadPlan(k) for k in keys]
        ask = []
        for p in plans:
            try:
                self._check_key(p.key)
                ask.append(p)
            except StoreError as e:
                p.error = e
        if not ask:
            return plans
        t_query = self._clock()
        res = self._master("batch_get_replica_list",
                           {"client_id": self.client_id, "keys": [p.key for p in ask]})
        answers = [self._batch_item(item) for item in res]
        queried = [t_query] * len(ask)  # when each lease was asked for (client clock)
        load_ix = [i for i, r in enumerate(answers) if isinstance(r, dict) and r.get("promote")]
        if load_ix and not load:
            for i in load_ix:
                answers[i] = _NEEDS_LOAD
            load_ix = []
        if load_ix:  # held only on SSD: the master loads them back into DRAM first
            res = self._master("load_replica_list", KeysRequest(
                self.client_id, tuple(ask[i].key for i in load_ix)))
            loaded = []
            for i, item in zip(load_ix, res, strict=True):
                answers[i] = self._batch_item(item)
                if not isinstance(answers[i], StoreError):
                    loaded.append(i)
            if loaded:  # a load may wait for room: ask again for a lease that starts now
                t_again = self._clock()
                res = self._master("batch_get_replica_list", {
                    "client_id": self.client_id, "keys": [ask[i].key for i in loaded]})
                for i, item in zip(loaded, res, strict=True):
                    r = self._batch_item(item)
                    if isinstance(r, dict) and r.get("promote"):
                        r = StoreError(ErrorCode.NO_AVAILABLE_HANDLE,  # retryable
                                       f"{ask[i].key!r} left DRAM again before it was read")
                    answers[i] = r
                    queried[i] = t_again
        now = self._clock()
        for p, r, t_asked in zip(ask, answers, queried, strict=True):
            if isinstance(r, StoreError):
                p.error = r
                continue
            rl = replica_list_from_wire(r)
            p.size = rl.size_bytes
            p.lease_expiry = (t_asked + rl.lease_ttl_ms / 1000.0 if rl.lease_ttl_ms > 0
                              else float("inf"))
            reps = [x for x in rl.replicas if x.tier == TIER_DRAM
                    and (not self._bad or self._bad.get(x.segment, 0.0) <= now)]
            self._rng.shuffle(reps)
            if prefer_local:
                reps.sort(key=lambda x: x.segment != self.segment_name)
            p.replicas = reps
            if not reps:
                p.error = StoreError(ErrorCode.OBJECT_NOT_FOUND,
                                     f"{p.key!r}: no reachable replica")
        return plans

    def _read(self, plans: list[_ReadPlan], dests: list[tuple[int, int] | None]) -> None:
        """Copy each planned object into ``dests[i] = (addr, capacity)``; replica fallback;
        sets ``plan.error`` on failure."""
        assert self._dp is not None
        pending = [i for i, p in enumerate(plans) if p.error is None]
        for i in pending:
            d = dests[i]
            if d is None or d[1] < plans[i].size:
                plans[i].error = StoreError(
                    ErrorCode.INVALID_PARAMS,
                    f"{plans[i].key!r}: buffer of {0 if d is None else d[1]} bytes < "
                    f"object of {plans[i].size}")
        pending = [i for i in pending if plans[i].error is None]
        while pending:
            moves = []
            for i in pending:
                rep = plans[i].replicas[0]
                moves.append(Move(False, dests[i][0], rep.segment, rep.addr, plans[i].size))
            results = self._dp.run(moves)
            nxt = []
            for i, r in zip(pending, results, strict=True):
                p = plans[i]
                rep = p.replicas.pop(0)
                if r.ok:
                    continue
                if r.peer_down:
                    self._bad[rep.segment] = self._clock() + self._bad_ttl
                    p.replicas = [x for x in p.replicas if x.segment != rep.segment]
                if p.replicas:
                    nxt.append(i)
                else:
                    p.error = StoreError(ErrorCode.OBJECT_NOT_FOUND,
                                         f"{p.key!r}: every replica failed ({r.reason})")
            pending = nxt
        for p in plans:
            self._finish_read(p)

    @staticmethod
    def _copy_out(views: list[np.ndarray]) -> list[bytes]:
        """Local-replica reads of one batch: a memcpy each out of this client's segment."""
        return [v.tobytes() for v in views]

    def _finish_read(self, p: _ReadPlan) -> None:
        """The one lease check of every read path, after the copy (case BUG-15)."""
        if p.error is _LOCAL_DONE or p.error is _NEEDS_LOAD:
            return  # checked by the caller once the local copy (or the load) is done
        if p.error is None and self._clock() >= p.lease_expiry:
            p.error = StoreError(ErrorCode.LEASE_EXPIRED,
                                 f"{p.key!r}: read lease lapsed before the copy completed")
        result = "hit" if p.error is None else (
            "miss" if p.error.code == ErrorCode.OBJECT_NOT_FOUND else "error")
        _GET_RESULT[result].inc()

    def get(self, key: str) -> bytes:
        """The value of ``key``. Raises ``StoreError`` (``OBJECT_NOT_FOUND``,
        ``REPLICA_IS_NOT_READY``, ``LEASE_EXPIRED``, ...)."""
        (v,) = self.batch_get([key])
        if isinstance(v, StoreError):
            raise v
        return v

    def batch_get(self, keys: Sequence[str], prefer_local: bool = True
                  ) -> list[bytes | StoreError]:
        """One value or ``StoreError`` per key. Keys held only on SSD are loaded back into
        DRAM by the master; when they do not all fit at once (a batch larger than the
        memory tier), the keys already read give their leases back and the rest are read
        in further rounds while each round makes progress, instead of the whole batch
        waiting out its RPC timeout (case BUG-62)."""
        t0 = time.perf_counter()
        keys = list(keys)
        out = self._batch_get_round(keys, prefer_local, load=False)
        todo = [i for i, v in enumerate(out) if v is _NEEDS_LOAD]
        done = [keys[i] for i, v in enumerate(out) if not isinstance(v, StoreError)]
        while todo:
            if done:  # read and copied: give the leases back so eviction may reuse the DRAM
                with contextlib.suppress(StoreError):
                    self.release_leases(done)
            chunk, todo = todo[:_LOAD_CHUNK], todo[_LOAD_CHUNK:]
            res = self._batch_get_round([keys[i] for i in chunk], prefer_local, load=True)
            done = []
            for i, v in zip(chunk, res, strict=True):
                out[i] = v
                if not isinstance(v, StoreError):
                    done.append(keys[i])
                elif v.code == ErrorCode.NO_AVAILABLE_HANDLE:
                    todo.append(i)  # no room yet: again after this chunk's leases are back
            if not done:  # a round without progress: the rest keep their errors
                break
        for i, v in enumerate(out):
            if v is _NEEDS_LOAD:
                out[i] = StoreError(ErrorCode.NO_AVAILABLE_HANDLE,
                                    f"{keys[i]!r}: no DRAM room to load it from SSD")
        _GET_LATENCY.observe(time.perf_counter() - t0)
        return out

    def _batch_get_round(self, keys: Sequence[str], prefer_local: bool, load: bool
                         ) -> list[bytes | StoreError]:
        plans = self._plan(keys, prefer_local, load)
        views: dict[int, np.ndarray] = {}
        for i, p in enumerate(plans):  # a replica in our own segment: one memcpy out
            if p.error is None and p.replicas and p.replicas[0].segment == self.segment_name:
                view = self._local_view(p.replicas[0].addr, p.size)
                if view is not None:
                    views[i] = view
                    p.error = _LOCAL_DONE
        local = dict(zip(views, self._copy_out(list(views.values())), strict=True)) \
            if views else {}
        stages: list[tuple[int, np.ndarray, Callable[[], None]] | None] = []
        try:
            for p in plans:
                stages.append(self._stage(p.size) if p.error is None and p.size else None)
            self._read(plans, [(s[0], s[1].nbytes) if s else None for s in stages])
            out: list[bytes | StoreError] = []
            for i, (p, s) in enumerate(zip(plans, stages, strict=True)):
                if i in local:
                    p.error = None
                    self._finish_read(p)
                    out.append(p.error if p.error is not None else local[i])
                else:
                    out.append(p.error if p.error is not None else s[1].tobytes())  # type: ignore
        finally:
            for s in stages:
                if s is not None:
                    s[2]()
        return out

    def get_into(self, key: str, addr: int, size: int) -> int:
        """Read ``key`` into ``[addr, addr+size)`` of a registered buffer; bytes read."""
        (v,) = self.batch_get_into([key], [addr], [size])
        if isinstance(v, StoreError):
            raise v
        return v

    def batch_get_into(self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int],
                       prefer_local: bool = True) -> list[int | StoreError]:
        if not len(keys) == len(addrs) == len(sizes):
            raise StoreError(ErrorCode.INVALID_PARAMS, "keys, addrs and sizes differ in length")
        plans = self._plan(keys, prefer_local)
        dests: list[tuple[int, int] | None] = []
        for p, a, s in zip(plans, addrs, sizes, strict=True):
            if p.error is None and not self._in_registered(a, min(s, p.size) or 1):
                p.error = StoreError(ErrorCode.INVALID_PARAMS,
                                     f"[{a:#x}, +{s}) is not inside a registered buffer")
            dests.append((a, s))
        self._read(plans, dests)
        return [p.error if p.error is not None else p.size for p in plans]

    def get_size(self, key: str) -> int:
        plans = self._plan([key], True)
        if plans[0].error is not None:
            raise plans[0].error
        return plans[0].size

    # -- metadata-only -----------------------------------------------------------------

    def _bad_now(self) -> list[str]:
        """Segments this client currently knows to have failed (see ``bad_segment_ttl_s``)."""
        if not self._bad:
            return []
        now = self._clock()
        return [seg for seg, until in list(self._bad.items()) if until > now]

    def exist(self, key: str) -> bool:
        """True for a published object with a replica this client may read: a key whose
        every replica lies on a segment this client knows to have failed is reported
        absent, as ``get`` answers ``OBJECT_NOT_FOUND`` for it (case BUG-34)."""
        self._check_key(key)
        req: dict[str, Any] = {"client_id": self.client_id, "key": key}
        bad = self._bad_now()
        if bad:
            req["exclude_segments"] = bad
        return bool(self._master("exist", req))

    def batch_exist(self, keys: Sequence[str]) -> list[bool | StoreError]:
        """``exist`` per key (same rule for keys on failed segments)."""
        req: dict[str, Any] = {"client_id": self.client_id, "keys": list(keys)}
        bad = self._bad_now()
        if bad:
            req["exclude_segments"] = bad
        res = self._master("batch_exist", req)
        return [self._batch_item(x) for x in res]

    def remove(self, key: str, force: bool = False) -> None:
        self._check_key(key)
        self._master("remove", RemoveRequest(self.client_id, key, force))

    def remove_all(self, force: bool = False) -> int:
        return int(self._master("remove_all", RemoveAllRequest(self.client_id, force)))

    def release_leases(self, keys: Sequence[str]) -> int:
        return int(self._master("release_leases", KeysRequest(self.client_id, tuple(keys))))

    def list_keys(self) -> list[str]:
        return list(self._master("list_keys", None))

    def stats(self) -> dict[str, Any]:
        return dict(self._master("stats", None))

    def ping(self) -> bool:
        try:
            return self._rpc.call("ping", None, timeout_s=2.0) == "pong"
        except RpcError:
            return False
    # -- two-phase primitives (for callers that write the bytes themselves) -------------

    def replica_list(self, key: str) -> ReplicaList:
        """The master's answer for ``key`` (grants a read lease)."""
        self._check_key(key)
        r = self._master("get_replica_list", {"client_id": self.client_id, "key": key})
        if r.get("promote"):
            (item,) = self._master("load_replica_list", KeysRequest(self.client_id, (key,)))
            r = self._batch_item(item)
            if isinstance(r, StoreError):
                raise r
        return replica_list_from_wire(r)

    def put_start(self, key: str, size_bytes: int,
                  config: ReplicateConfig | None = None) -> PutHandle:
        self._check_key(key)
        return put_handle_from_wire(self._master("put_start", {
            "client_id": self.client_id, "key": key, "size_bytes": size_bytes,
            "config": to_wire(config or _DEFAULT_CONFIG)}))

    def put_end(self, key: str, generation: int) -> None:
        self._master("put_end", {"client_id": self.client_id, "key": key,
                                 "generation": generation})

    def put_revoke(self, key: str, generation: int) -> None:
        self._master("put_revoke", PutEndRequest(self.client_id, key, generation))
