"""TransferEngine: segments, batch transfers over local/shm/tcp, failover (DESIGN.md §4).

Mooncake FAST'25 §3.2.3 and the open-source Mooncake Transfer Engine: a process registers
memory (its *segment*), publishes the segment's descriptor to the metadata service, and
moves bytes between its registered memory and any other segment's with batch transfers::

    batch = engine.allocate_batch(2)
    engine.submit(batch, [TransferRequest(TransferOp.WRITE, local_addr, "peer", remote_addr, n),
                          ...])
    statuses = engine.wait(batch)      # or: await engine.wait_async(batch)
    engine.free_batch(batch)

Rules (BUG-36, BUG-37, BUG-38):

* Every request is checked at ``submit`` before any I/O: a local or target range outside
  registered memory fails ``INVALID_ARGUMENT``; an unpublished target segment fails
  ``NOT_FOUND``; ``length == 0`` completes at once (an OK no-op); an empty request list is
  an OK no-op. The target checks tcp slices against its own ranges again.
* ``local`` and ``shm`` requests are copied inside ``submit`` (their status is final when it
  returns). ``tcp`` requests are cut into slices that the peer's paths (one pooled TCP
  connection each) take from a shared queue, so bandwidths add up.
* A pooled connection found closed by the peer (idle gap, peer restart) is reopened and
  its slices re-sent at once. A path that fails on a fresh connection is marked down for
  ``path_retry_interval_s``; its slices go to the other paths. A slice that failed
  ``max_retries + 1`` times fails its request with ``CONNECTION_ERROR``/``TIMEOUT`` and the
  reason, within ``TransferConfig.failure_bound_s``: nothing waits forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pymooncake.metadata import (
    EventKind,
    LeaseId,
    LeaseNotFound,
    MetadataStore,
    WatchEvent,
    open_metadata,
)
from pymooncake.obs.logging import init_logger
from pymooncake.transfer import metrics as m
from pymooncake.transfer import slicing
from pymooncake.transfer.batch import (
    PENDING,
    BatchId,
    SegmentNameTaken,
    StatusCode,
    TransferError,
    TransferOp,
    TransferRequest,
    TransferState,
    TransferStatus,
)
from pymooncake.transfer.config import TransferConfig
from pymooncake.transfer.memory import (
    MemoryRegion,
    MemoryRegistry,
    PeerMapping,
    SharedBuffer,
    buffer_address,
)
from pymooncake.transfer.paths import TcpPaths
from pymooncake.transfer.segment import (
    SEGMENT_KEY_PREFIX,
    BufferDesc,
    SegmentDescriptor,
    local_host_id,
    segment_key,
)
from pymooncake.transfer.topology import Topology, get_topology
from pymooncake.transfer.transports import local as local_transport
from pymooncake.transfer.transports import tcp
from pymooncake.transfer.transports.base import Slice

logger = init_logger(__name__)
T = TypeVar("T")
_LATENCY = {t: m.latency_seconds.labels(t) for t in ("none", "local", "shm", "tcp")}
_BYTES_NO_PATH = {t: m.bytes_total.labels(t, "-") for t in ("local", "shm")}

@dataclass(slots=True, eq=False)
class _Req:
    status: TransferStatus
    transport: str = ""
    remaining: int = 0
    nbytes: int = 0
    t0: float = 0.0


@dataclass(slots=True, eq=False)
class _Batch:
    batch_id: BatchId
    capacity: int
    reqs: list[_Req] = field(default_factory=list)
    num_pending: int = 0
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = field(
        default_factory=list)


class TransferEngine:
    """One process's Transfer Engine (its segment is named ``name``).

    ``metadata`` is a :class:`~pymooncake.metadata.MetadataStore` or a URL for
    :func:`~pymooncake.metadata.open_metadata`. All methods are synchronous and
    thread-safe except :meth:`wait_async`; the engine owns a small event-loop thread for
    metadata calls, a TCP data server thread (plus one per accepted connection) and one
    thread per path of each peer it talks to.
    """

    def __init__(self, name: str, metadata: MetadataStore | str = "embedded://", *,
                 config: TransferConfig | None = None) -> None:
        if not name or "/" in name:
            raise ValueError(f"segment name must be non-empty without '/', got {name!r}")
        self.name = name
        self.config = config or TransferConfig()
        self.metadata: MetadataStore = (open_metadata(metadata) if isinstance(metadata, str)
                                        else metadata)
        self.registry = MemoryRegistry()
        self.topology: Topology = get_topology(self.config.topology_file)
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._num_waiting = 0  # threads in wait(): notify only when someone listens
        self._batches: dict[int, _Batch] = {}
        self._batch_ids = itertools.count(1)
        self._peers: dict[str, SegmentDescriptor] = {}
        self._mappings: dict[str, PeerMapping] = {}
        self._owned_shm: dict[int, SharedBuffer] = {}
        self._paths = TcpPaths(self.config, self.topology, self._finish_slices,
                               lambda name: self._resolve(name, refresh=True))
        self._version = 0
        self._started = False
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self.server: tcp.TcpDataServer | None = None
        self._watch_future: Any = None
        self._keepalive_future: Any = None
        self._lease: LeaseId | None = None
        self._publish_lock: asyncio.Lock | None = None
        self.segment_metadata: Callable[[str], MetadataStore] | None = None
        """Where to look a segment up, when not in ``metadata`` (the compat facade's
        P2P handshake mode: segment ``host:port`` publishes on its own server)."""

    # ------------------------------------------------------------------ lifecycle
    @property
    def segment_name(self) -> str:
        return self.name

    @property
    def tcp_port(self) -> int:
        return self.server.port if self.server is not None else 0

    def start(self) -> TransferEngine:
        """Start the data server and publish the segment descriptor; returns ``self``.

        The descriptor is created put-if-absent under a lease of ``config.segment_ttl_s``
        that the engine keeps alive, so one segment name has one live owner. Raises
        :class:`~pymooncake.transfer.SegmentNameTaken` when another engine publishes this
        name (it frees up when that engine closes, or its lease lapses after a crash),
        :class:`~pymooncake.metadata.MetadataError` when the metadata service is
        unreachable and ``OSError`` when the TCP port cannot be bound.
        """
        if self._started:
            return self
        if self._closed:
            raise TransferError("engine is closed; create a new TransferEngine")
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run_loop() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()

        self._loop = loop
        self._loop_thread = threading.Thread(target=run_loop, daemon=True,
                                             name=f"transfer-loop-{self.name}")
        self._loop_thread.start()
        ready.wait(5)
        if "tcp" in self.config.transports:
            self.server = tcp.TcpDataServer(self.config.host, self.config.tcp_port,
                                            self.registry)
        self._started = True
        try:
            self._run(self._claim())
        except BaseException:
            self.close()
            raise
        self._watch_future = asyncio.run_coroutine_threadsafe(self._watch_segments(), loop)
        self._keepalive_future = asyncio.run_coroutine_threadsafe(self._keep_alive(), loop)
        return self

    async def _claim(self) -> None:
        """Create the descriptor put-if-absent under a fresh lease (the engine loop).

        Raises :class:`SegmentNameTaken` naming the current owner when the key exists.
        """
        if self._publish_lock is None:
            self._publish_lock = asyncio.Lock()
        async with self._publish_lock:
            await self._claim_locked()

    async def _claim_locked(self) -> None:
        md, key = self.metadata, segment_key(self.name)
        lease = await md.grant_lease(self.config.segment_ttl_s)
        owner = "another engine"
        try:
            for _ in range(3):  # the owner may withdraw between create and get
                self._version += 1
                if await md.create(key, self.descriptor().encode(), lease_id=lease):
                    self._lease = lease
                    return
                kv = await md.get(key)
                if kv is not None:
                    owner = _describe_owner(kv.value)
                    break
        except BaseException:
            with contextlib.suppress(Exception):
                await md.revoke_lease(lease)
            raise
        with contextlib.suppress(Exception):
            await md.revoke_lease(lease)
        raise SegmentNameTaken(self.name, owner, md.url)

    async def _publish_async(self) -> None:
        assert self._publish_lock is not None
        async with self._publish_lock:
            if self._lease is None:  # lost (metadata restart, expiry): claim again
                await self._claim_locked()
                return
            self._version += 1
            try:
                await self.metadata.put(segment_key(self.name), self.descriptor().encode(),
                                        lease_id=self._lease)
            except LeaseNotFound:
                self._lease = None
                await self._claim_locked()

    async def _keep_alive(self) -> None:
        """Keep the descriptor's lease alive; re-claim the name if the lease was lost."""
        interval_s = self.config.segment_ttl_s / 3
        while not self._closed:
            await asyncio.sleep(interval_s)
            assert self._publish_lock is not None
            try:
                async with self._publish_lock:
                    if self._closed:
                        return
                    if self._lease is not None:
                        try:
                            await self.metadata.keep_alive(self._lease)
                            continue
                        except LeaseNotFound:
                            logger.warning("segment %r: lease lost (metadata restarted or "
                                           "keep-alive late); publishing again", self.name)
                            self._lease = None
                    await self._claim_locked()
            except asyncio.CancelledError:
                raise
            except SegmentNameTaken as e:
                logger.error("segment %r could not be published again: %s", self.name, e)
            except Exception as e:  # noqa: BLE001 - metadata down: retry next interval
                logger.info("segment %r: keep-alive failed: %r; retrying", self.name, e)

    async def _watch_segments(self) -> None:
        """Keep cached peer descriptors current: drop withdrawn ones, follow new ports."""
        while not self._closed:
            try:
                watch = await self.metadata.watch_prefix(SEGMENT_KEY_PREFIX)
            except Exception as e:  # noqa: BLE001 - metadata down: retry later
                logger.info("segment watch could not start: %r; retrying", e)
                await asyncio.sleep(1.0)
                continue
            try:
                async for ev in watch:
                    self._on_segment_event(ev)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a broken watch is restarted
                logger.info("segment watch ended: %r; restarting", e)
                await asyncio.sleep(0.5)
            finally:
                with contextlib.suppress(Exception):
                    await watch.close()

    def _on_segment_event(self, ev: WatchEvent) -> None:
        name = ev.key[len(SEGMENT_KEY_PREFIX):]
        if name == self.name:
            return
        if ev.kind is EventKind.DELETE:
            self._peers.pop(name, None)
            return
        if name not in self._peers:
            return  # not a peer of ours: resolved on first use
        try:
            desc = SegmentDescriptor.decode(ev.value)
        except ValueError:
            return
        self._peers[name] = desc
        self._paths.update_address(name, desc.host, desc.tcp_port)

    def close(self) -> None:
        """Stop paths and the server, withdraw the descriptor, free owned shared memory.

        Every engine thread (loop, data server, accepted connections, paths) has ended
        when this returns: connections are shut down first, so a path blocked in a
        window to an unresponsive peer fails it at once. Pending requests end
        ``INTERNAL`` ("engine closed").
        """
        if self._closed:
            return
        self._closed = True
        with self._lock:
            for b in self._batches.values():
                for r in b.reqs:
                    if r.status.state is TransferState.PENDING:
                        r.status = TransferStatus.failed(StatusCode.INTERNAL, "engine closed")
                b.num_pending = 0
                self._wake_async(b)
            self._done.notify_all()
        self._paths.close()
        for fut in (self._watch_future, self._keepalive_future):
            if fut is not None:
                fut.cancel()
        if self.server is not None:
            self.server.close()
        if self._started and self._loop is not None:
            with contextlib.suppress(Exception):
                self._run(self._withdraw())
            with contextlib.suppress(Exception):
                self._run(self.metadata.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._loop_thread is not None:
                self._loop_thread.join(timeout=5)
            self._loop.close()
        for mapping in self._mappings.values():
            mapping.close()
        for shm in self._owned_shm.values():
            shm.close()

    def __enter__(self) -> TransferEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        assert self._loop is not None, "engine not started"
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result(timeout=self.config.metadata_timeout_s)

    # ------------------------------------------------------------------ segments
    def descriptor(self) -> SegmentDescriptor:
        """This engine's segment descriptor as it is published."""
        return SegmentDescriptor(
            name=self.name, host=self.config.host, host_id=local_host_id(), pid=os.getpid(),
            tcp_port=self.tcp_port, transports=self.config.transports,
            buffers=tuple(BufferDesc(r.addr, r.length, r.shm_name)
                          for r in self.registry.regions),
            version=self._version)

    def _publish(self) -> None:
        if self._started and not self._closed:
            self._run(self._publish_async())

    async def _withdraw(self) -> None:
        """Revoke the lease, which deletes the descriptor (only ours: never another's)."""
        async with self._publish_lock or contextlib.nullcontext():
            lease, self._lease = self._lease, None
            if lease is not None:
                await self.metadata.revoke_lease(lease)

    def register_memory(self, buffer: object) -> int:
        """Register a contiguous buffer; returns its base address.

        Accepts bytearray, mmap, numpy arrays, torch CPU tensors and :class:`SharedBuffer`
        (the only kind same-host peers reach with ``shm``; others go over ``tcp``). The
        buffer must stay alive until :meth:`unregister_memory`. Raises ``ValueError`` for a
        non-contiguous, empty, overlapping or CUDA buffer, ``TypeError`` for a non-buffer.
        """
        addr, nbytes, keepalive = buffer_address(buffer)
        shm_name = buffer.name if isinstance(buffer, SharedBuffer) else None
        self.registry.add(MemoryRegion(addr, nbytes, keepalive, shm_name))
        self._publish()
        return addr

    def register_memory_at(self, addr: int, length: int) -> int:
        """Register raw memory ``[addr, addr+length)`` owned by the caller (Mooncake style)."""
        if addr <= 0 or length <= 0:
            raise ValueError(f"need addr > 0 and length > 0, got {addr:#x} and {length}")
        self.registry.add(MemoryRegion(addr, length, None))
        self._publish()
        return addr

    def allocate_shared(self, length: int) -> SharedBuffer:
        """A new registered :class:`SharedBuffer` (freed by unregister or :meth:`close`)."""
        shm = SharedBuffer(length)
        self._owned_shm[shm.addr] = shm
        try:
            self.register_memory(shm)
        except Exception:
            self._owned_shm.pop(shm.addr).close()
            raise
        return shm

    def unregister_memory(self, addr_or_buffer: int | object) -> None:
        """Withdraw a registered range (by base address or the registered object).

        Raises ``KeyError`` when nothing is registered there.
        """
        addr = (addr_or_buffer if isinstance(addr_or_buffer, int)
                else buffer_address(addr_or_buffer)[0])
        self.registry.remove(addr)
        self._publish()
        shm = self._owned_shm.pop(addr, None)
        if shm is not None:
            shm.close()

    def _resolve(self, segment: str, refresh: bool = False) -> SegmentDescriptor | None:
        if not refresh:
            desc = self._peers.get(segment)
            if desc is not None:
                return desc
        md = self.metadata if self.segment_metadata is None else self.segment_metadata(segment)
        kv = self._run(md.get(segment_key(segment)))
        if kv is None:
            self._peers.pop(segment, None)
            return None
        desc = SegmentDescriptor.decode(kv.value)
        self._peers[segment] = desc
        return desc

    def get_first_buffer_address(self, segment: str) -> int:
        """Base address of a segment's first registered buffer (0 when none / unknown)."""
        if segment == self.name:
            regions = self.registry.regions
            return regions[0].addr if regions else 0
        desc = self._resolve(segment, refresh=True)
        return desc.buffers[0].addr if desc and desc.buffers else 0

    # ------------------------------------------------------------------ batches
    def allocate_batch(self, n: int) -> BatchId:
        """A batch that can hold up to ``n`` requests."""
        if n < 0:
            raise ValueError(f"batch size must be >= 0, got {n}")
        self._check_open()
        with self._lock:
            bid = BatchId(next(self._batch_ids))
            self._batches[bid] = _Batch(bid, n)
        return bid

    def free_batch(self, batch_id: BatchId) -> None:
        """Release a finished batch. Raises ``TransferError`` while requests are pending."""
        with self._lock:
            batch = self._get_batch(batch_id)
            if batch.num_pending:
                raise TransferError(f"batch {batch_id} still has {batch.num_pending} pending "
                                    "requests; wait for it before freeing")
            del self._batches[batch_id]

    def _get_batch(self, batch_id: BatchId) -> _Batch:
        batch = self._batches.get(batch_id)
        if batch is None:
            raise TransferError(f"unknown batch id {batch_id} (never allocated or freed)")
        return batch

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("engine is closed")
        if not self._started:
            raise TransferError("engine not started; call start() first")

    def submit(self, batch_id: BatchId, requests: Sequence[TransferRequest]) -> int:
        """Validate and start ``requests`` in the batch (see the module doc for the rules).

        Returns how many of ``requests`` were refused at submit (their status is already
        ``FAILED``; nothing was written for them). Raises ``TransferError`` for an unknown
        batch or when the batch would overflow its capacity; per-request problems become
        failed statuses, never exceptions.
        """
        return self._submit(batch_id, requests, inline=False)

    def _submit(self, batch_id: BatchId, requests: Sequence[TransferRequest],
                inline: bool) -> int:
        """:meth:`submit`; with ``inline`` the caller's thread runs the tcp windows itself
        on an idle path (see ``TcpPaths.run_inline``) and returns when they are done."""
        self._check_open()
        # Route every request first (no side effects beyond caches), then record the
        # whole submission under one lock: refused ones final, tcp ones with their slices.
        verdicts = [self._route(req) for req in requests]
        now = time.monotonic()
        copies: list[tuple[int, TransferRequest, int]] = []
        tcp_work: dict[str, tuple[SegmentDescriptor, list[Slice]]] = {}
        num_refused = 0
        with self._lock:
            batch = self._get_batch(batch_id)
            reqs = batch.reqs
            if len(reqs) + len(requests) > batch.capacity:
                raise TransferError(f"batch {batch_id} holds {batch.capacity} requests; "
                                    f"{len(reqs)} used, {len(requests)} more submitted")
            for req, verdict in zip(requests, verdicts, strict=True):
                idx = len(reqs)
                if isinstance(verdict, TransferStatus):  # refused, or a 0-byte no-op
                    reqs.append(_Req(verdict, "none", 0, 0, now))
                    if verdict.state is TransferState.FAILED:
                        num_refused += 1
                        m.failures_total.labels("none", verdict.code.value).inc()
                    else:
                        _LATENCY["none"].observe(0.0)
                    continue
                batch.num_pending += 1
                if verdict[0] == "tcp":
                    slices = self._slices(batch_id, idx, req)
                    reqs.append(_Req(PENDING, "tcp", len(slices), req.length, now))
                    work = tcp_work.get(req.target_segment)
                    if work is None:
                        desc = verdict[2]
                        assert desc is not None
                        work = tcp_work[req.target_segment] = (desc, [])
                    work[1].extend(slices)
                else:
                    reqs.append(_Req(PENDING, verdict[0], 0, req.length, now))
                    copies.append((idx, req, verdict[1]))
            if batch.num_pending == 0:
                self._wake_locked(batch)
        for idx, req, target_addr in copies:
            transport = "local" if req.target_segment == self.name else "shm"
            local_transport.copy(req.op, req.local_addr, target_addr, req.length)
            _BYTES_NO_PATH[transport].inc(req.length)
            self._finish_request(batch_id, idx, _completed(req.length), transport)
        for desc, slices in tcp_work.values():
            if inline:
                self._paths.run_inline(desc, slices)
            else:
                self._paths.enqueue(desc, slices)
        return num_refused

    def _route(self, req: TransferRequest
               ) -> TransferStatus | tuple[str, int, SegmentDescriptor | None]:
        """A final status (refused, or a no-op) or ``(transport, mapped target address,
        target descriptor)`` (the descriptor is ``None`` for ``local``)."""
        if req.length < 0:
            return TransferStatus.failed(StatusCode.INVALID_ARGUMENT,
                                         f"length must be >= 0, got {req.length}")
        if req.length == 0:
            return TransferStatus.completed(0)
        if self.registry.find(req.local_addr, req.length) is None:
            return TransferStatus.failed(
                StatusCode.INVALID_ARGUMENT,
                f"local range [{req.local_addr:#x}, +{req.length}) is outside every "
                "registered buffer of this engine")
        if req.target_segment == self.name:
            if self.registry.find(req.target_addr, req.length) is None:
                return _bad_target(req)
            return ("local", req.target_addr, None)
        try:
            desc = self._resolve(req.target_segment)
            buf = desc.find(req.target_addr, req.length) if desc else None
            if desc is not None and buf is None:  # maybe registered since we cached it
                desc = self._resolve(req.target_segment, refresh=True)
                buf = desc.find(req.target_addr, req.length) if desc else None
        except Exception as e:  # noqa: BLE001 - metadata failures become a status
            return TransferStatus.failed(StatusCode.INTERNAL, f"metadata lookup failed: {e!r}")
        if desc is None:
            return TransferStatus.failed(
                StatusCode.NOT_FOUND,
                f"segment {req.target_segment!r} is not published in {self.metadata.url}")
        if buf is None:
            return _bad_target(req)
        if (buf.shm_name and "shm" in self.config.transports and "shm" in desc.transports
                and desc.host_id == local_host_id()):
            try:
                mapping = self._map(buf)
                return ("shm", mapping.addr + (req.target_addr - buf.addr), desc)
            except OSError as e:
                logger.info("shm mapping of %s failed (%r); using tcp", buf.shm_name, e)
        if "tcp" in self.config.transports and "tcp" in desc.transports and desc.tcp_port:
            return ("tcp", req.target_addr, desc)
        return TransferStatus.failed(
            StatusCode.INVALID_ARGUMENT,
            f"no common transport with {req.target_segment!r} (ours {self.config.transports},"
            f" theirs {desc.transports})")

    def _map(self, buf: BufferDesc) -> PeerMapping:
        assert buf.shm_name is not None
        with self._lock:
            mapping = self._mappings.get(buf.shm_name)
        if mapping is None:
            mapping = PeerMapping(buf.shm_name, buf.length)
            with self._lock:
                mapping = self._mappings.setdefault(buf.shm_name, mapping)
        return mapping

    def _slices(self, batch_id: BatchId, idx: int, req: TransferRequest) -> list[Slice]:
        cfg = self.config
        if req.length <= cfg.min_slice_bytes:  # one slice (the common small request)
            return [Slice(req.op, req.local_addr, req.target_addr, req.length, batch_id, idx)]
        size = slicing.slice_size(req.length, cfg.num_paths, cfg.min_slice_bytes,
                                  cfg.max_slice_bytes)
        return [Slice(req.op, req.local_addr + off, req.target_addr + off, n, batch_id, idx)
                for off, n in slicing.split(req.length, size)]

    def _finish_locked(self, batch: _Batch, idx: int, status: TransferStatus,
                       transport: str) -> None:
        """Make request ``idx`` final (the engine lock is held)."""
        r = batch.reqs[idx]
        if r.status.state is not TransferState.PENDING:
            return
        r.status = status
        batch.num_pending -= 1
        if status.state is TransferState.FAILED:
            m.failures_total.labels(transport, status.code.value).inc()
        else:
            _LATENCY[transport].observe(time.monotonic() - r.t0)
        if batch.num_pending == 0:
            self._wake_locked(batch)

    def _wake_locked(self, batch: _Batch) -> None:
        """Wake whoever waits for ``batch`` (the engine lock is held)."""
        if self._num_waiting:
            self._done.notify_all()
        if batch.waiters:
            self._wake_async(batch)

    def _finish_request(self, batch_id: BatchId, idx: int, status: TransferStatus,
                        transport: str) -> None:
        with self._lock:
            batch = self._batches.get(batch_id)
            if batch is not None:
                self._finish_locked(batch, idx, status, transport)

    def _finish_slices(self, outcomes: Sequence[tuple[Slice, StatusCode, str]]) -> None:
        """Record slice outcomes (one lock for a whole window)."""
        if len(outcomes) == 1 and outcomes[0][1] is StatusCode.OK:  # one small request
            s = outcomes[0][0]
            with self._lock:
                batch = self._batches.get(s.batch_id)
                if batch is not None:
                    r = batch.reqs[s.request_index]
                    if r.status.state is TransferState.PENDING:
                        r.remaining -= 1
                        if not r.remaining:
                            self._finish_locked(batch, s.request_index, _completed(r.nbytes),
                                                "tcp")
            return
        with self._lock:
            for s, code, msg in outcomes:
                batch = self._batches.get(s.batch_id)
                if batch is None:
                    continue
                r = batch.reqs[s.request_index]
                if r.status.state is not TransferState.PENDING:
                    continue
                if code is not StatusCode.OK:
                    self._finish_locked(batch, s.request_index,
                                        TransferStatus.failed(code, msg), "tcp")
                    continue
                r.remaining -= 1
                if not r.remaining:
                    self._finish_locked(batch, s.request_index, _completed(r.nbytes), "tcp")

    @staticmethod
    def _wake_async(batch: _Batch) -> None:
        for loop, fut in batch.waiters:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_set_done, fut)
        batch.waiters.clear()

    def status(self, batch_id: BatchId, i: int) -> TransferStatus:
        """Status of request ``i`` (0-based) of the batch.

        Raises ``TransferError`` for an unknown batch and ``IndexError`` (naming the batch,
        the index and how many requests it holds) when ``i`` is out of range.
        """
        with self._lock:
            reqs = self._get_batch(batch_id).reqs
            if not 0 <= i < len(reqs):
                held = (f"indices 0..{len(reqs) - 1}" if reqs else "none submitted yet")
                raise IndexError(f"batch {batch_id} has no request {i}: it holds "
                                 f"{len(reqs)} submitted requests ({held})")
            return reqs[i].status

    def statuses(self, batch_id: BatchId) -> list[TransferStatus]:
        with self._lock:
            return [r.status for r in self._get_batch(batch_id).reqs]

    def wait(self, batch_id: BatchId, timeout_s: float | None = None) -> list[TransferStatus]:
        """Block until every submitted request of the batch is final, or ``timeout_s``.

        Returns the per-request statuses (still ``PENDING`` ones if it timed out). Without
        a timeout it still returns: every slice ends within ``config.failure_bound_s``.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            batch = self._get_batch(batch_id)
            while batch.num_pending and not self._closed:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._num_waiting += 1
                try:
                    self._done.wait(timeout=remaining)
                finally:
                    self._num_waiting -= 1
            return [r.status for r in batch.reqs]

    async def wait_async(self, batch_id: BatchId,
                         timeout_s: float | None = None) -> list[TransferStatus]:
        """:meth:`wait` for coroutines: awaits completion without blocking the loop."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._lock:
            batch = self._get_batch(batch_id)
            if batch.num_pending == 0:
                return [r.status for r in batch.reqs]
            batch.waiters.append((loop, fut))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(fut, timeout=timeout_s)
        return self.statuses(batch_id)

    def transfer_sync(self, op: TransferOp, local_addr: int, target_segment: str,
                      target_addr: int, length: int) -> TransferStatus:
        """One request, submitted and waited for."""
        return self.batch_transfer_sync(
            [TransferRequest(op, local_addr, target_segment, target_addr, length)])[0]

    def batch_transfer_sync(self, requests: Sequence[TransferRequest],
                            timeout_s: float | None = None) -> list[TransferStatus]:
        """Submit ``requests`` as one batch, wait, free; the per-request statuses.

        The calling thread does the tcp I/O itself on an idle path (no hand-off to a path
        thread and back), with the other paths' threads helping on larger batches.
        """
        bid = self.allocate_batch(len(requests))
        try:
            self._submit(bid, requests, inline=True)
            with self._lock:  # usually all done inline: collect and free in one go
                batch = self._batches.get(bid)
                if batch is not None and not batch.num_pending:
                    del self._batches[bid]
                    return [r.status for r in batch.reqs]
            statuses = self.wait(bid, timeout_s)
        except BaseException:
            with contextlib.suppress(TransferError):
                self.free_batch(bid)
            raise
        with contextlib.suppress(TransferError):
            self.free_batch(bid)
        return statuses

_COMPLETED: dict[int, TransferStatus] = {}


def _completed(nbytes: int) -> TransferStatus:
    """``TransferStatus.completed(nbytes)``, shared (statuses are immutable)."""
    st = _COMPLETED.get(nbytes)
    if st is None:
        if len(_COMPLETED) >= 4096:
            _COMPLETED.clear()
        st = _COMPLETED[nbytes] = TransferStatus.completed(nbytes)
    return st


def _describe_owner(value: bytes) -> str:
    try:
        d = SegmentDescriptor.decode(value)
    except ValueError:
        return "an engine with an unreadable descriptor"
    return f"pid {d.pid} on {d.host} (tcp port {d.tcp_port}, host id {d.host_id})"


def _bad_target(req: TransferRequest) -> TransferStatus:
    return TransferStatus.failed(
        StatusCode.INVALID_ARGUMENT,
        f"target range [{req.target_addr:#x}, +{req.length}) is outside every registered "
        f"buffer of segment {req.target_segment!r}")


def _set_done(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


