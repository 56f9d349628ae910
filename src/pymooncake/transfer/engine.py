"""TransferEngine: segments, batch transfers over local/shm/cma/tcp, failover (DESIGN.md §4).

Mooncake FAST'25 §3.2.3 and the open-source Mooncake Transfer Engine: a process registers
memory (its *segment*), publishes the segment's descriptor to the metadata service, and
moves bytes between its registered memory and any other segment's with batch transfers::

    batch = engine.allocate_batch(2)
    engine.submit(batch, [TransferRequest(TransferOp.WRITE, local_addr, "peer", remote_addr, n),
                          ...])
    statuses = engine.wait(batch)      # or: await engine.wait_async(batch)
    engine.free_batch(batch)

The parts: ``publisher.py`` (the descriptor on the metadata service, peer lookups),
``routing.py`` (submit-time checks, transport choice, slicing), ``batch_table.py``
(statuses and waiting), ``transports/local.py`` (the copy thread; ``cma.py`` for copies
into a same-host peer's ordinary memory), ``paths.py`` and
``transports/tcp.py`` (tcp paths and the wire).

Rules (BUG-36, BUG-37, BUG-38, BUG-64):

* Every request is checked at ``submit`` before any I/O: a local or target range outside
  registered memory fails ``INVALID_ARGUMENT``; an unpublished target segment fails
  ``NOT_FOUND``; ``length == 0`` completes at once (an OK no-op); an empty request list is
  an OK no-op. The target checks every tcp slice against its own registered ranges again
  and never trusts the peer's address or length.
* ``submit`` returns before the bytes move: ``local``, ``shm`` and ``cma`` requests go to
  the engine's copy thread (``memmove`` or ``process_vm_writev``/``readv`` without the
  GIL), ``tcp`` requests are cut into slices
  that the peer's paths (one pooled TCP connection each) take from a shared queue, so
  bandwidths add up. ``batch_transfer_sync`` does the work in the calling thread (it
  waits anyway): copies directly, tcp windows on an idle path.
* A pooled connection found closed by the peer (idle gap, peer restart) is reopened and
  its slices re-sent at once. A path that fails on a fresh connection is marked down for
  ``path_retry_interval_s``; its slices go to the other paths. A slice that failed
  ``max_retries + 1`` times fails its request with ``CONNECTION_ERROR``/``TIMEOUT`` and the
  reason, within ``TransferConfig.failure_bound_s``: nothing waits forever.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence

from pymooncake.metadata import MetadataStore, open_metadata
from pymooncake.transfer import metrics as m
from pymooncake.transfer.batch import (
    PENDING,
    BatchId,
    TransferError,
    TransferOp,
    TransferRequest,
    TransferState,
    TransferStatus,
)
from pymooncake.transfer.batch_table import BatchTable, RequestState, observe_noop
from pymooncake.transfer.config import TransferConfig
from pymooncake.transfer.engine_memory import SegmentMemory
from pymooncake.transfer.lone import sync_one
from pymooncake.transfer.memory import (
    MemoryRegistry,
    SharedBuffer,
)
from pymooncake.transfer.paths import TcpPaths
from pymooncake.transfer.publisher import SegmentPublisher
from pymooncake.transfer.routing import Route, Router
from pymooncake.transfer.segment import BufferDesc, SegmentDescriptor, local_host_id
from pymooncake.transfer.topology import Topology, get_topology
from pymooncake.transfer.transports import local as local_transport
from pymooncake.transfer.transports import tcp
from pymooncake.transfer.transports.base import Slice
from pymooncake.transfer.transports.cma import CmaAnchor, CmaPeer
from pymooncake.transfer.transports.local import CopyJob, LocalCopier


class TransferEngine(SegmentMemory):
    """One process's Transfer Engine (its segment is named ``name``).

    ``metadata`` is a :class:`~pymooncake.metadata.MetadataStore` or a URL for
    :func:`~pymooncake.metadata.open_metadata`. All methods are synchronous and
    thread-safe except :meth:`wait_async`; the engine owns a small event-loop thread for
    metadata calls, a TCP data server thread (plus one per accepted connection), one
    thread per path of each peer it talks to and a copy thread for local/shm/cma requests.
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
        self._batches = BatchTable()
        self._owned_shm: dict[int, SharedBuffer] = {}
        self._publisher = SegmentPublisher(name, self.metadata, self.config, self._descriptor,
                                           self._peer_moved)
        self._cma_anchor = CmaAnchor(name) if "cma" in self.config.transports else None
        self._router = Router(name, self.config, self.registry, self._publisher.resolve,
                              lambda: self.metadata.url,
                              lambda segment: self._publisher.peers.pop(segment, None))
        self._paths = TcpPaths(self.config, self.topology, self._batches.finish_slices,
                               lambda name: self._publisher.resolve(name, True))
        self._copier = LocalCopier(name, self._batches.finish_copies)
        self._started = False
        self._closed = False
        self.server: tcp.TcpDataServer | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def segment_name(self) -> str:
        return self.name

    @property
    def tcp_port(self) -> int:
        return self.server.port if self.server is not None else 0

    @property
    def segment_metadata(self) -> Callable[[str], MetadataStore] | None:
        """Where to look a segment up, when not in ``metadata`` (the compat facade's
        P2P handshake mode: segment ``host:port`` publishes on its own server)."""
        return self._publisher.segment_metadata

    @segment_metadata.setter
    def segment_metadata(self, fn: Callable[[str], MetadataStore] | None) -> None:
        self._publisher.segment_metadata = fn

    @property
    def _peers(self) -> dict[str, SegmentDescriptor]:
        return self._publisher.peers

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
        self._started = True
        try:
            if "tcp" in self.config.transports:
                self.server = tcp.TcpDataServer(self.config.host, self.config.tcp_port,
                                                self.registry,
                                                read_timeout_s=self.config.slice_timeout_s)
            self._publisher.start()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop paths and the server, withdraw the descriptor, free owned shared memory.

        Every engine thread (loop, data server, accepted connections, paths, copies) has
        ended when this returns: connections are shut down first, so a path blocked in a
        window to an unresponsive peer fails it at once. Pending requests end
        ``INTERNAL`` ("engine closed").
        """
        if self._closed:
            return
        self._closed = True
        if self._cma_anchor is not None:
            self._cma_anchor.publish(tuple, close=True)  # none from now on, for good
        self._copier.close()
        self._batches.fail_all("engine closed")
        self._paths.close()
        if self.server is not None:
            self.server.close()
        if self._started:
            self._publisher.close()
        self._router.close()
        for shm in self._owned_shm.values():
            shm.close()

    def __enter__(self) -> TransferEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ segments
    def descriptor(self) -> SegmentDescriptor:
        """This engine's segment descriptor as it is published."""
        return self._descriptor(self._publisher.version)

    def _descriptor(self, version: int) -> SegmentDescriptor:
        return SegmentDescriptor(
            name=self.name, host=self.config.host, host_id=local_host_id(), pid=os.getpid(),
            tcp_port=self.tcp_port, transports=self.config.transports,
            buffers=tuple(BufferDesc(r.addr, r.length, r.shm_name)
                          for r in self.registry.regions),
            version=version, **self._cma_fields())

    def _cma_fields(self) -> dict[str, int | str]:
        a = self._cma_anchor
        return {} if a is None else {"cma_anchor": a.addr, "cma_token": a.token.hex()}

    def _peer_moved(self, name: str, host: str, port: int) -> None:
        self._paths.update_address(name, host, port)

    def _publish(self) -> None:
        if self._started and not self._closed:
            self._publisher.publish()

    def _resolve(self, segment: str, refresh: bool = False) -> SegmentDescriptor | None:
        return self._publisher.resolve(segment, refresh)

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
        return self._batches.allocate(n)

    def free_batch(self, batch_id: BatchId) -> None:
        """Release a finished batch. Raises ``TransferError`` while requests are pending."""
        self._batches.free(batch_id)

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
        failed statuses, never exceptions. Accepted requests complete later, on the copy
        thread or the tcp paths (small local/shm/cma copies while that thread is idle: before
        this returns, ``TransferConfig.inline_copy_max_bytes``): wait for them with
        :meth:`wait` or :meth:`wait_async`.
        """
        return self._submit(batch_id, requests, inline=False)

    def _submit(self, batch_id: BatchId, requests: Sequence[TransferRequest], inline: bool,
                verdicts: list[TransferStatus | Route] | None = None,
                tried: Slice | None = None) -> int:
        """:meth:`submit`; with ``inline`` the caller's thread does the copies and runs the
        tcp windows itself on an idle path (``TcpPaths.run_inline``) before returning.
        ``verdicts``: the requests' routes when known; ``tried``: the lone request's slice
        that already failed ``tried.retries`` times (``lone.sync_one``)."""
        self._check_open()
        # Route every request first (no side effects beyond caches), then record the
        # whole submission under one lock: refused ones final, the rest pending.
        if verdicts is None:
            verdicts = [self._router.route(req) for req in requests]
        now = time.monotonic()
        copies: list[CopyJob] = []
        tcp_work: dict[str, tuple[SegmentDescriptor, list[Slice]]] = {}
        num_refused = 0
        table = self._batches
        with table.lock:
            batch = table.get_locked(batch_id)
            reqs = batch.reqs
            if len(reqs) + len(requests) > batch.capacity:
                raise TransferError(f"batch {batch_id} holds {batch.capacity} requests; "
                                    f"{len(reqs)} used, {len(requests)} more submitted")
            for req, verdict in zip(requests, verdicts, strict=True):
                idx = len(reqs)
                if isinstance(verdict, TransferStatus):  # refused, or a 0-byte no-op
                    reqs.append(RequestState(verdict, "none", 0, 0, now))
                    if verdict.state is TransferState.FAILED:
                        num_refused += 1
                        m.failures_total.labels("none", verdict.code.value).inc()
                    else:
                        observe_noop()
                    continue
                batch.num_pending += 1
                transport, target_addr, desc, local = verdict
                if transport == "tcp":
                    slices = self._router.slices(batch_id, idx, req, local)
                    if tried is not None:
                        for x in slices:
                            x.retries, x.last_error = tried.retries, tried.last_error
                    state = RequestState(PENDING, "tcp", len(slices), req.length, now)
                    reqs.append(self._router.own(slices, state))
                    work = tcp_work.get(req.target_segment)
                    if work is None:
                        assert isinstance(desc, SegmentDescriptor)
                        work = tcp_work[req.target_segment] = (desc, [])
                    work[1].extend(slices)
                else:
                    reqs.append(RequestState(PENDING, transport, 0, req.length, now))
                    copies.append(CopyJob(req.op, req.local_addr, target_addr, req.length,
                                          batch_id, idx, transport,
                                          desc if isinstance(desc, CmaPeer) else None))
            if batch.num_pending == 0:
                table.wake_locked(batch)
        if copies:
            if inline:
                local_transport.run_copies(copies, self._batches.finish_copies)
            else:
                self._copier.submit(copies, self.config.inline_copy_max_bytes)
        for desc, slices in tcp_work.values():
            if inline:
                self._paths.run_inline(desc, slices)
            else:
                self._paths.enqueue(desc, slices)
        return num_refused

    def status(self, batch_id: BatchId, i: int) -> TransferStatus:
        """Status of request ``i`` (0-based) of the batch.

        Raises ``TransferError`` for an unknown batch and ``IndexError`` (naming the batch,
        the index and how many requests it holds) when ``i`` is out of range.
        """
        return self._batches.status(batch_id, i)

    def statuses(self, batch_id: BatchId) -> list[TransferStatus]:
        return self._batches.statuses(batch_id)

    def wait(self, batch_id: BatchId, timeout_s: float | None = None) -> list[TransferStatus]:
        """Block until every submitted request of the batch is final, or ``timeout_s``.

        Returns the per-request statuses (still ``PENDING`` ones if it timed out). Without
        a timeout it still returns: every slice ends within ``config.failure_bound_s``.
        """
        return self._batches.wait(batch_id, timeout_s)

    async def wait_async(self, batch_id: BatchId,
                         timeout_s: float | None = None) -> list[TransferStatus]:
        """:meth:`wait` for coroutines: awaits completion without blocking the loop."""
        return await self._batches.wait_async(batch_id, timeout_s)

    def transfer_sync(self, op: TransferOp, local_addr: int, target_segment: str,
                      target_addr: int, length: int) -> TransferStatus:
        """One request, submitted and waited for."""
        return self.batch_transfer_sync(
            [TransferRequest(op, local_addr, target_segment, target_addr, length)])[0]

    def batch_transfer_sync(self, requests: Sequence[TransferRequest],
                            timeout_s: float | None = None) -> list[TransferStatus]:
        """Submit ``requests`` as one batch, wait, free; the per-request statuses.

        The calling thread does the work itself (copies; tcp I/O on an idle path, with the
        other paths' threads helping on larger batches): no hand-off and wake-up; a lone
        one-slice tcp request without even a batch (``lone.sync_one``).
        """
        verdicts, tried = None, None
        if len(requests) == 1:
            self._check_open()
            one = sync_one(self._router, self._paths, self.config, requests[0])
            if isinstance(one, TransferStatus):
                return [one]
            verdicts, tried = one
        bid = self.allocate_batch(len(requests))
        try:
            self._submit(bid, requests, True, verdicts, tried)
            statuses = self._batches.pop_if_done(bid)  # usually all done inline
            if statuses is not None:
                return statuses
            statuses = self.wait(bid, timeout_s)
        except BaseException:
            with contextlib.suppress(TransferError):
                self.free_batch(bid)
            raise
        with contextlib.suppress(TransferError):
            self.free_batch(bid)
        return statuses
