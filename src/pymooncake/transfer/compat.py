"""Mooncake-compatible facade: ``TransferEngine`` with Mooncake's Python method names.

Follows the ``mooncake.engine.TransferEngine`` API of the open-source Mooncake Transfer
Engine (see ../shared/MOONCAKE.md): integer addresses, ``0``/``-1`` return codes, batch ids
that are ``0`` on failure, and ``transfer_check_status`` → ``1`` done, ``0`` pending,
``-1`` failed, ``-2`` timeout. Code written for Mooncake's engine (e.g. the Mooncake KV
connectors of vLLM and SGLang) runs on it with ``protocol="tcp"``.

``metadata_server`` may be ``http://h:p/metadata``, ``etcd://h:p``, ``embedded://...`` or
``"P2PHANDSHAKE"``: then every engine serves its own descriptor on a small HTTP metadata
server whose port is :meth:`TransferEngine.get_rpc_port`, and its segment name is
``"<host>:<rpc port>"``, as in Mooncake.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import threading
import time

from pymooncake.metadata import MetadataStore, open_metadata
from pymooncake.obs.logging import init_logger
from pymooncake.transfer.batch import (
    BatchId,
    TransferError,
    TransferOp,
    TransferRequest,
    TransferState,
)
from pymooncake.transfer.compat_util import (
    TransferNotify,
    conn_string,
    local_topology_json,
    probe,
)
from pymooncake.transfer.config import TransferConfig
from pymooncake.transfer.engine import TransferEngine as _Engine
from pymooncake.transfer.memory import SharedBuffer, view_at

logger = init_logger(__name__)

OK, FAILED = 0, -1
STATUS_DONE, STATUS_PENDING, STATUS_FAILED, STATUS_TIMEOUT = 1, 0, -1, -2
SYNC_TIMEOUT_S = 30.0
"""Mooncake's sync-call timeout: 30 s plus 1 ns per byte."""


class TransferOpcode(enum.Enum):
    """Mooncake's ``TransferEngine.TransferOpcode``."""

    Read = 0
    Write = 1


class TransferEngine:
    """Mooncake's Python ``TransferEngine`` over :class:`pymooncake.transfer.TransferEngine`."""

    TransferOpcode = TransferOpcode
    TransferNotify = TransferNotify

    def __init__(self) -> None:
        self._engine: _Engine | None = None
        self._p2p_server = None
        self._managed: dict[int, SharedBuffer] = {}
        self._peer_md: dict[str, MetadataStore] = {}
        self._lock = threading.Lock()
        self._deadlines: dict[int, float] = {}
        self._metadata_url = ""

    # ------------------------------------------------------------------ set-up
    def initialize(self, local_hostname: str, metadata_server: str, protocol: str,
                   device_name: str = "") -> int:
        """Start the engine; 0 on success, -1 on failure (logged)."""
        try:
            if protocol not in ("tcp", "shm"):
                raise ValueError(f"protocol {protocol!r} is not supported (use tcp)")
            host, _, port_s = local_hostname.partition(":")
            host = host or "127.0.0.1"
            cfg = TransferConfig(host=host if host != "localhost" else "127.0.0.1")
            if metadata_server.upper() in ("P2PHANDSHAKE", "P2P"):
                from pymooncake.metadata.http import MetadataHttpServer

                self._p2p_server = MetadataHttpServer(cfg.host, int(port_s or 0)).start()
                name = f"{host}:{self._p2p_server.port}"
                engine = _Engine(name, open_metadata(self._p2p_server.url), config=cfg)
                engine.segment_metadata = self._p2p_metadata
            else:
                engine = _Engine(local_hostname, metadata_server, config=cfg)
                self._metadata_url = metadata_server
            engine.start()
            self._engine = engine
            return OK
        except Exception as e:  # noqa: BLE001 - Mooncake reports failure as -1
            logger.error("initialize failed: %s: %s", type(e).__name__, e)
            self._shutdown_p2p()
            return FAILED

    def initialize_ext(self, local_hostname: str, metadata_server: str, protocol: str,
                       device_name: str = "", metadata_type: str = "etcd") -> int:
        """``initialize`` with the metadata service given as address + type (``etcd``,
        ``http``, ``p2p``); a full URL or ``P2PHANDSHAKE`` is taken as is."""
        return self.initialize(local_hostname, conn_string(metadata_server, metadata_type),
                               protocol, device_name)

    @staticmethod
    def get_local_topology(device_name: str | None = None) -> str:
        """This host's topology as Mooncake prints it: ``{"cpu:N": [[preferred NICs],
        [secondary NICs]]}``, restricted to ``device_name`` when given."""
        return local_topology_json(device_name)

    def send_probe(self, peer_server_name: str) -> int:
        """0 when the peer's segment is published and its data port answers, else -1."""
        if self._engine is None:
            return FAILED
        url = (f"http://{peer_server_name}/metadata" if self._p2p_server is not None
               else self._metadata_url)
        return probe(url, peer_server_name) if url else FAILED

    def get_notifies(self) -> list[TransferNotify]:
        """Notifications received (``transfer_sync(..., notify=...)``). pymooncake's
        transports carry none, so this is always ``[]``."""
        return []

    def _p2p_metadata(self, segment: str) -> MetadataStore:
        with self._lock:
            md = self._peer_md.get(segment)
            if md is None:
                md = self._peer_md[segment] = open_metadata(f"http://{segment}/metadata")
            return md

    def _shutdown_p2p(self) -> None:
        if self._p2p_server is not None:
            self._p2p_server.stop()
            self._p2p_server = None

    @property
    def engine(self) -> _Engine:
        if self._engine is None:
            raise TransferError("TransferEngine not initialized; call initialize() first")
        return self._engine

    def get_rpc_port(self) -> int:
        if self._p2p_server is not None:
            return self._p2p_server.port
        return self.engine.tcp_port

    def get_local_segment_name(self) -> str:
        return self.engine.segment_name

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        for buf in self._managed.values():
            buf.close()
        self._managed.clear()
        self._shutdown_p2p()

    # ------------------------------------------------------------------ memory
    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        try:
            self.engine.register_memory_at(int(buffer_addr), int(capacity))
            return OK
        except (ValueError, TransferError) as e:
            logger.error("register_memory failed: %s", e)
            return FAILED

    def unregister_memory(self, buffer_addr: int) -> int:
        try:
            self.engine.unregister_memory(int(buffer_addr))
            return OK
        except (KeyError, TransferError) as e:
            logger.error("unregister_memory failed: %s", e)
            return FAILED

    def batch_register_memory(self, buffer_addresses: list[int], capacities: list[int],
                              location: str = "*") -> int:
        if len(buffer_addresses) != len(capacities):
            return FAILED
        done: list[int] = []
        for a, c in zip(buffer_addresses, capacities, strict=True):
            if self.register_memory(a, c) != OK:
                for x in done:
                    self.unregister_memory(x)
                return FAILED
            done.append(a)
        return OK

    def batch_unregister_memory(self, buffer_addresses: list[int]) -> int:
        results = [self.unregister_memory(a) for a in buffer_addresses]
        return OK if all(r == OK for r in results) else FAILED

    def allocate_managed_buffer(self, length: int) -> int:
        """A registered (shared-memory) buffer's address, or 0 on failure."""
        try:
            buf = self.engine.allocate_shared(int(length))
        except (ValueError, OSError, TransferError) as e:
            logger.error("allocate_managed_buffer failed: %s", e)
            return 0
        self._managed[buf.addr] = buf
        return buf.addr

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        buf = self._managed.pop(int(buffer_addr), None)
        if buf is None:
            return FAILED
        with contextlib.suppress(KeyError):
            self.engine.unregister_memory(buf.addr)
        buf.close()
        return OK

    def get_first_buffer_address(self, segment_name: str) -> int:
        try:
            return self.engine.get_first_buffer_address(segment_name)
        except Exception as e:  # noqa: BLE001 - Mooncake returns 0 when unknown
            logger.error("get_first_buffer_address failed: %r", e)
            return 0

    def write_bytes_to_buffer(self, buffer_addr: int, src: bytes, length: int) -> int:
        if self.engine.registry.find(int(buffer_addr), int(length)) is None:
            return FAILED
        ctypes.memmove(int(buffer_addr), bytes(src[:length]), int(length))
        return OK

    def read_bytes_from_buffer(self, buffer_addr: int, length: int) -> bytes:
        if self.engine.registry.find(int(buffer_addr), int(length)) is None:
            return b""
        return bytes(view_at(int(buffer_addr), int(length)))

    # ------------------------------------------------------------------ transfers
    def _requests(self, op: TransferOp, target: str, local: list[int], remote: list[int],
                  lengths: list[int]) -> list[TransferRequest] | None:
        if not (len(local) == len(remote) == len(lengths)):
            logger.error("batch transfer: buffers, peer addresses and lengths differ in count")
            return None
        return [TransferRequest(op, int(a), target, int(b), int(n))
                for a, b, n in zip(local, remote, lengths, strict=True)]

    def _sync(self, op: TransferOp, target: str, local: list[int], remote: list[int],
              lengths: list[int]) -> int:
        reqs = self._requests(op, target, local, remote, lengths)
        if reqs is None:
            return FAILED
        try:
            timeout_s = SYNC_TIMEOUT_S + sum(max(0, r.length) for r in reqs) * 1e-9
            st = self.engine.batch_transfer_sync(reqs, timeout_s=timeout_s)
        except TransferError as e:
            logger.error("transfer failed: %s", e)
            return FAILED
        bad = [s for s in st if not s.ok]
        for s in bad[:1]:
            logger.error("transfer to %s failed: %s", target, s.reason or s.state.value)
        return OK if not bad else FAILED

    def transfer_sync_write(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                            length: int, transport_hint: str = "") -> int:
        return self._sync(TransferOp.WRITE, target_hostname, [buffer], [peer_buffer_address],
                          [length])

    def transfer_sync_read(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                           length: int, transport_hint: str = "") -> int:
        return self._sync(TransferOp.READ, target_hostname, [buffer], [peer_buffer_address],
                          [length])

    def batch_transfer_sync_write(self, target_hostname: str, buffers: list[int],
                                  peer_buffer_addresses: list[int], lengths: list[int],
                                  transport_hint: str = "") -> int:
        return self._sync(TransferOp.WRITE, target_hostname, buffers, peer_buffer_addresses,
                          lengths)

    def batch_transfer_sync_read(self, target_hostname: str, buffers: list[int],
                                 peer_buffer_addresses: list[int], lengths: list[int],
                                 transport_hint: str = "") -> int:
        return self._sync(TransferOp.READ, target_hostname, buffers, peer_buffer_addresses,
                          lengths)

    def _async(self, op: TransferOp, target: str, local: list[int], remote: list[int],
               lengths: list[int]) -> int:
        reqs = self._requests(op, target, local, remote, lengths)
        if reqs is None:
            return 0
        try:
            bid = self.engine.allocate_batch(len(reqs))
            num_refused = self.engine.submit(bid, reqs)
        except TransferError as e:
            logger.error("async transfer failed: %s", e)
            return 0
        if reqs and num_refused == len(reqs):
            # Every request was refused at submit (nothing was started): Mooncake's
            # "batch id, 0 on failure". A batch with some started requests keeps its id
            # and reports the refused ones through its status.
            logger.error("async transfer to %s refused: %s", target,
                         self.engine.status(bid, 0).reason)
            with contextlib.suppress(TransferError):
                self.engine.free_batch(bid)
            return 0
        self._deadlines[bid] = (time.monotonic() + SYNC_TIMEOUT_S
                                + sum(max(0, r.length) for r in reqs) * 1e-9)
        return int(bid)

    def batch_transfer_async_write(self, target_hostname: str, buffers: list[int],
                                   peer_buffer_addresses: list[int], lengths: list[int],
                                   transport_hint: str = "") -> int:
        """A batch id (> 0), or 0 when the batch could not be started: bad arguments, or
        every request refused at submit (range outside registered memory, unknown segment,
        negative length). When only some are refused the id is returned and
        :meth:`get_batch_transfer_status` / :meth:`transfer_check_status` report failure."""
        return self._async(TransferOp.WRITE, target_hostname, buffers, peer_buffer_addresses,
                           lengths)

    def batch_transfer_async_read(self, target_hostname: str, buffers: list[int],
                                  peer_buffer_addresses: list[int], lengths: list[int],
                                  transport_hint: str = "") -> int:
        return self._async(TransferOp.READ, target_hostname, buffers, peer_buffer_addresses,
                           lengths)

    def transfer_submit_write(self, target_hostname: str, buffer: int,
                              peer_buffer_address: int, length: int,
                              transport_hint: str = "") -> int:
        """One asynchronous write: a batch id for :meth:`transfer_check_status` /
        :meth:`get_batch_transfer_status`, or 0 when it could not be started."""
        return self._async(TransferOp.WRITE, target_hostname, [buffer], [peer_buffer_address],
                           [length])

    @staticmethod
    def _op(opcode: TransferOpcode | int) -> TransferOp:
        value = opcode.value if isinstance(opcode, enum.Enum) else int(opcode)
        return TransferOp.WRITE if value == TransferOpcode.Write.value else TransferOp.READ

    def transfer_sync(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                      length: int, opcode: TransferOpcode, notify: object = None) -> int:
        """Mooncake's generic form; ``notify`` is accepted and ignored."""
        return self._sync(self._op(opcode), target_hostname, [buffer], [peer_buffer_address],
                          [length])

    def batch_transfer_sync(self, target_hostname: str, buffers: list[int],
                            peer_buffer_addresses: list[int], lengths: list[int],
                            opcode: TransferOpcode, notify: object = None) -> int:
        return self._sync(self._op(opcode), target_hostname, buffers, peer_buffer_addresses,
                          lengths)

    def batch_transfer_async(self, target_hostname: str, buffers: list[int],
                             peer_buffer_addresses: list[int], lengths: list[int],
                             opcode: TransferOpcode, *args: object, **kwargs: object) -> int:
        return self._async(self._op(opcode), target_hostname, buffers, peer_buffer_addresses,
                           lengths)

    def _finish(self, batch_id: int) -> None:
        self._deadlines.pop(batch_id, None)
        with contextlib.suppress(TransferError):
            self.engine.free_batch(BatchId(batch_id))

    def get_batch_transfer_status(self, batch_ids: list[int]) -> int:
        """Block until every batch is done; 0 when all succeeded, else -1. Frees them."""
        result = OK
        for bid in batch_ids:
            try:
                timeout_s = max(0.0, self._deadlines.get(bid, 0.0) - time.monotonic())
                st = self.engine.wait(BatchId(bid), timeout_s=timeout_s or None)
            except TransferError:
                result = FAILED
                continue
            if not all(s.ok for s in st):
                result = FAILED
            if all(s.state is not TransferState.PENDING for s in st):
                self._finish(bid)
        return result

    def transfer_check_status(self, batch_id: int) -> int:
        """1 done, 0 pending, -1 failed (or unknown), -2 past the sync timeout."""
        try:
            st = self.engine.statuses(BatchId(batch_id))
        except TransferError:
            return STATUS_FAILED
        if any(s.state is TransferState.FAILED for s in st) and not any(
                s.state is TransferState.PENDING for s in st):
            self._finish(batch_id)
            return STATUS_FAILED
        if any(s.state is TransferState.PENDING for s in st):
            if time.monotonic() > self._deadlines.get(batch_id, float("inf")):
                return STATUS_TIMEOUT
            return STATUS_PENDING
        self._finish(batch_id)
        return STATUS_DONE
