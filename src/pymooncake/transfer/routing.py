"""Submit-time checks and transport choice for each request (BUG-37, BUG-38).

:meth:`Router.route` answers, before any I/O, either a final status (refused, or an OK
no-op for ``length == 0``) or the transport that moves the request: ``local`` (the target
is this engine), ``shm`` (a same-host peer's shared-memory buffer, mapped here), ``cma`` (a
same-host peer's other memory, when both offer it and the peer's anchor reads back:
``transports/cma.py``) or ``tcp``.
Both ranges are checked against registered memory: ours in the registry, the target's in
its published descriptor (re-read once when the cached one does not cover the range).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from pymooncake.obs.logging import init_logger
from pymooncake.transfer import slicing
from pymooncake.transfer.batch import (
    BatchId,
    StatusCode,
    TransferRequest,
    TransferStatus,
)
from pymooncake.transfer.config import TransferConfig
from pymooncake.transfer.memory import MemoryRegion, MemoryRegistry, PeerMapping
from pymooncake.transfer.segment import BufferDesc, SegmentDescriptor, local_host_id
from pymooncake.transfer.transports.base import Slice
from pymooncake.transfer.transports.cma import CmaPeer, in_address_space
from pymooncake.transfer.transports.cma_peers import CmaPeers

logger = init_logger(__name__)

Route = tuple[str, int, SegmentDescriptor | CmaPeer | None, MemoryRegion]
"""``(transport, target address in this process or the peer's, the target's descriptor
(tcp, shm) or its :class:`CmaPeer` (cma), the registered local region)``."""

_NOOP = TransferStatus.completed(0)
_S = TypeVar("_S")


class Router:
    """Routes requests of the engine named ``name``; owns the peers' shm mappings."""

    def __init__(self, name: str, config: TransferConfig, registry: MemoryRegistry,
                 resolve: Callable[[str, bool], SegmentDescriptor | None],
                 metadata_url: Callable[[], str],
                 stale: Callable[[str], None] = lambda segment: None) -> None:
        self.name = name
        self.config = config
        self.registry = registry
        self._resolve = resolve
        self._metadata_url = metadata_url
        self._lock = threading.Lock()
        self.mappings: dict[str, PeerMapping] = {}
        self._host_id = local_host_id()
        self.cma = CmaPeers(stale)
        """Peers reached by ``cma`` (``stale(segment)`` drops a cached descriptor)."""

    def route(self, req: TransferRequest) -> TransferStatus | Route:
        if req.length < 0:
            return TransferStatus.failed(StatusCode.INVALID_ARGUMENT,
                                         f"length must be >= 0, got {req.length}")
        if req.length == 0:
            return _NOOP
        try:
            inside = (in_address_space(req.local_addr, req.length)
                      and in_address_space(req.target_addr, req.length))
        except TypeError:
            return TransferStatus.failed(
                StatusCode.INVALID_ARGUMENT,
                f"addresses and length must be integers, got {req.local_addr!r}, "
                f"{req.target_addr!r}, {req.length!r}")
        if not inside:
            return TransferStatus.failed(
                StatusCode.INVALID_ARGUMENT,
                f"range of {req.length} bytes at {req.local_addr:#x} (local) or "
                f"{req.target_addr:#x} (target) is outside a 64-bit address space")
        local = self.registry.find(req.local_addr, req.length)
        if local is None:
            return TransferStatus.failed(
                StatusCode.INVALID_ARGUMENT,
                f"local range [{req.local_addr:#x}, +{req.length}) is outside every "
                "registered buffer of this engine")
        if req.target_segment == self.name:
            if self.registry.find(req.target_addr, req.length) is None:
                return bad_target(req)
            return ("local", req.target_addr, None, local)
        try:
            desc = self._resolve(req.target_segment, False)
            buf = desc.find(req.target_addr, req.length) if desc else None
            if desc is not None and buf is None:  # maybe registered since we cached it
                desc = self._resolve(req.target_segment, True)
                buf = desc.find(req.target_addr, req.length) if desc else None
        except Exception as e:  # noqa: BLE001 - metadata failures become a status
            return TransferStatus.failed(StatusCode.INTERNAL, f"metadata lookup failed: {e!r}")
        if desc is None:
            self.cma.forget(req.target_segment)
            return TransferStatus.failed(
                StatusCode.NOT_FOUND,
                f"segment {req.target_segment!r} is not published in {self._metadata_url()}")
        if buf is None:
            return bad_target(req)
        cfg = self.config
        if (buf.shm_name and "shm" in cfg.transports and "shm" in desc.transports
                and desc.host_id == self._host_id):
            try:
                mapping = self.map(buf)
                return ("shm", mapping.addr + (req.target_addr - buf.addr), desc, local)
            except OSError as e:
                logger.info("shm mapping of %s failed (%r); using tcp", buf.shm_name, e)
        cma_refused = ""
        if (desc.cma_anchor and "cma" in cfg.transports and "cma" in desc.transports
                and desc.host_id == self._host_id):
            peer = self.cma.peer(req.target_segment, desc.pid, desc.cma_anchor,
                                 desc.cma_token)  # the name asked for, not the one inside
            if not isinstance(peer, str):
                return ("cma", req.target_addr, peer, local)
            cma_refused = f"; cma refused: {peer}"
        if "tcp" in cfg.transports and "tcp" in desc.transports and desc.tcp_port:
            return ("tcp", req.target_addr, desc, local)
        return TransferStatus.failed(
            StatusCode.INVALID_ARGUMENT,
            f"no common transport with {req.target_segment!r} (ours {cfg.transports},"
            f" theirs {desc.transports}{cma_refused})")

    def map(self, buf: BufferDesc) -> PeerMapping:
        """The peer's shared buffer mapped here (mapped once, kept until :meth:`close`)."""
        assert buf.shm_name is not None
        with self._lock:
            mapping = self.mappings.get(buf.shm_name)
        if mapping is None:
            mapping = PeerMapping(buf.shm_name, buf.length)
            with self._lock:
                kept = self.mappings.setdefault(buf.shm_name, mapping)
            if kept is not mapping:
                mapping.close()
            mapping = kept
        return mapping

    def slices(self, batch_id: BatchId, idx: int, req: TransferRequest,
               local: MemoryRegion) -> list[Slice]:
        """The tcp slices of request ``idx`` (one for a request of ≤ ``min_slice_bytes``),
        each with its view of ``local``, the registered region holding the local range."""
        cfg = self.config
        view = local.view_of(req.local_addr, req.length)
        if req.length <= cfg.min_slice_bytes:  # one slice (the common small request)
            return [Slice(req.op, req.local_addr, req.target_addr, req.length, batch_id, idx,
                          view=view)]
        size = slicing.slice_size(req.length, cfg.num_paths, cfg.min_slice_bytes,
                                  cfg.max_slice_bytes)
        return [Slice(req.op, req.local_addr + off, req.target_addr + off, n, batch_id, idx,
                      view=view[off:off + n])
                for off, n in slicing.split(req.length, size)]

    @staticmethod
    def own(slices: list[Slice], state: _S) -> _S:
        """Point every slice of a request at its batch-table ``state``; returns ``state``."""
        for s in slices:
            s.owner = state
        return state

    def close(self) -> None:
        self.cma.close()
        with self._lock:
            mappings = list(self.mappings.values())
            self.mappings.clear()
        for mapping in mappings:
            mapping.close()


def bad_target(req: TransferRequest) -> TransferStatus:
    return TransferStatus.failed(
        StatusCode.INVALID_ARGUMENT,
        f"target range [{req.target_addr:#x}, +{req.length}) is outside every registered "
        f"buffer of segment {req.target_segment!r}")
