"""The tcp transport's target side: :class:`TcpDataServer` (BUG-64: trusts no peer input).

The target checks every slice against its own registered ranges, the same
:class:`~pymooncake.transfer.memory.MemoryRegistry` that submit-time checks use, before it
touches its memory; payloads are received straight into registered memory and READ
payloads sent straight from it (``sendmsg`` of memoryviews). Replies of a window are held
(up to ``REPLY_FLUSH_BYTES``) and sent with one ``sendmsg``.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import zlib
from collections.abc import Callable

from pymooncake.obs.logging import init_logger
from pymooncake.transfer.batch import TransferOp
from pymooncake.transfer.memory import MemoryRegion, MemoryRegistry
from pymooncake.transfer.transports.wire import (
    ADDR_LIMIT,
    FLAG_CLOSING,
    FLAG_CRC,
    FLAG_MORE,
    LINGER_BYTES,
    RECV_BUFFER_BYTES,
    REP,
    REP_MAGIC,
    REPLY_FLUSH_BYTES,
    REQ,
    REQ_MAGIC,
    SERVER_MAX_SLICE_BYTES,
    ST_CRC,
    ST_INVALID,
    ST_OK,
    RecvBuffer,
    sendmsg_all,
    timeval,
)

logger = init_logger(__name__)

class TcpDataServer:
    """Serves slices into/out of ``registry`` on ``host:port`` (one thread per connection).

    Nothing a peer sends is trusted (BUG-64): a header whose range is not inside one
    registered buffer (``registry``, the table submit-time checks use too), whose length
    exceeds ``SERVER_MAX_SLICE_BYTES`` or whose address plus length overflows is refused
    before any byte of that memory is read or written: the server answers
    ``INVALID_ARGUMENT`` with ``FLAG_CLOSING`` and ends the session (draining, into
    scratch space and for a bounded time, what the peer still sends so that it reads the
    reply). A started header or payload must arrive within ``read_timeout_s`` per
    receive (``SO_RCVTIMEO``, so the socket stays blocking and ``MSG_WAITALL`` works) and
    within ``read_timeout_s`` plus one second per MiB in all; otherwise the session is
    dropped. An idle connection (between requests) may stay open.

    ``fault_drop_after_slices`` (tests only): after that many wire requests on one
    connection (a slice, or a run of contiguous slices: ``tcp.runs``), the server closes
    that connection in the middle of the next one, once.
    """

    def __init__(self, host: str, port: int, registry: MemoryRegistry, *,
                 read_timeout_s: float = 5.0) -> None:
        self.registry = registry
        self.read_timeout_s = read_timeout_s
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.host = host
        self.port = int(self._listener.getsockname()[1])
        self._conns: set[socket.socket] = set()
        self._conn_threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.fault_drop_after_slices: int | None = None
        self.on_slice: Callable[[int, int], None] | None = None
        self._accept_thread = threading.Thread(target=self._accept_loop, daemon=True,
                                               name=f"tcp-data-accept-{self.port}")
        self._accept_thread.start()

    def _accept_loop(self) -> None:
        rcvtimeo = timeval(self.read_timeout_s)
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, rcvtimeo)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
                t = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                     name=f"tcp-data-conn-{self.port}")
                self._conn_threads.add(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        reader = RecvBuffer(conn)
        pending: list[memoryview | bytes] = []
        pending_bytes = 0
        num_slices = 0
        timeout_s = self.read_timeout_s
        # the region of the previous request (the usual hit), while the registry that
        # held it is unchanged (nothing unregistered since: the same snapshot)
        last: MemoryRegion | None = None
        last_snap: tuple[MemoryRegion, ...] = ()
        registry = self.registry
        try:
            while True:
                if reader.empty and not reader.wait_readable():
                    return  # the peer closed between requests
                magic, op, flags, _, seq, addr, length, crc = reader.read_struct(
                    REQ, time.monotonic() + timeout_s)
                if magic != REQ_MAGIC or op not in (0, 1):
                    logger.warning("tcp data server: malformed request header; closing link")
                    return
                num_slices += 1
                if (self.fault_drop_after_slices is not None
                        and num_slices > self.fault_drop_after_slices):
                    self.fault_drop_after_slices = None
                    logger.warning("tcp data server: injected fault, dropping connection")
                    return
                if (last is not None and last.addr <= addr and length <= SERVER_MAX_SLICE_BYTES
                        and addr + length <= last.addr + last.length
                        and registry.regions is last_snap):
                    region = last  # inside the region the previous request used
                else:
                    last_snap = registry.regions
                    region, refusal = self._check(addr, length)
                if region is None:
                    msg = refusal.encode()
                    pending.append(REP.pack(REP_MAGIC, ST_INVALID, FLAG_CLOSING, len(msg),
                                            seq, 0, 0) + msg)
                    sendmsg_all(conn, pending)
                    logger.info("tcp data server: refused a slice (%s); closing the session",
                                refusal)
                    _linger(conn, self.read_timeout_s)
                    return
                last = region
                view = region.view_of(addr, length)
                if op == TransferOp.WRITE:
                    reader.read_into(view, time.monotonic() + timeout_s + length / 2**20)
                    status = ST_OK
                    if flags & FLAG_CRC and zlib.crc32(view) != crc:
                        status = ST_CRC
                    reply: list[memoryview | bytes] = [REP.pack(REP_MAGIC, status, 0, 0, seq,
                                                                0, 0)]
                else:
                    rcrc = zlib.crc32(view) if flags & FLAG_CRC else 0
                    reply = [REP.pack(REP_MAGIC, ST_OK, flags & FLAG_CRC, 0, seq, length,
                                      rcrc), view]
                if self.on_slice is not None:
                    self.on_slice(op, length)
                if not flags & FLAG_MORE and not pending:  # a lone reply: send it as is
                    sendmsg_all(conn, reply)
                    continue
                pending.extend(reply)
                for b in reply:
                    pending_bytes += len(b)
                if not flags & FLAG_MORE or pending_bytes >= REPLY_FLUSH_BYTES:
                    sendmsg_all(conn, pending)
                    pending.clear()
                    pending_bytes = 0
        except (TimeoutError, BlockingIOError):
            logger.info("tcp data server: a request was not received within %.1f s; "
                        "dropping the session", timeout_s)
        except OSError as e:  # ConnectionError (closed mid-request), reset, shut down
            logger.debug("tcp data server: connection ended: %r", e)
        except Exception as e:  # noqa: BLE001 - never leave a half-read stream spinning
            logger.error("tcp data server: session failed: %r", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._conn_threads.discard(threading.current_thread())
            with contextlib.suppress(OSError):
                conn.close()

    def _check(self, addr: int, length: int) -> tuple[MemoryRegion | None, str]:
        """``(the registered region holding [addr, addr+length), "")``, or ``(None, why
        that range may not be touched)``."""
        if length > SERVER_MAX_SLICE_BYTES:
            return None, (f"slice length {length} exceeds the limit of "
                          f"{SERVER_MAX_SLICE_BYTES} bytes")
        if addr + length > ADDR_LIMIT:
            return None, f"address {addr:#x} plus length {length} overflows 64 bits"
        region = self.registry.find(addr, length)
        if region is None:
            return None, (f"target range [{addr:#x}, {addr + length:#x}) is outside every "
                          "registered buffer of this segment")
        return region, ""

    def drop_connections(self) -> int:
        """Close every accepted connection (the listener stays); the number closed."""
        with self._lock:
            conns = list(self._conns)
            self._conns.clear()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()
        return len(conns)

    def close(self, join_timeout_s: float = 2.0) -> None:
        """Stop accepting, close every connection and join the server's threads.

        ``close()`` alone does not wake a thread blocked in ``accept()`` on Linux;
        ``shutdown`` does (the accept fails with ``EINVAL``).
        """
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._listener.close()
        self.drop_connections()
        deadline = time.monotonic() + join_timeout_s
        with self._lock:
            threads = [self._accept_thread, *self._conn_threads]
        for t in threads:
            if t is not threading.current_thread():
                t.join(timeout=max(0.0, deadline - time.monotonic()))


def _linger(conn: socket.socket, timeout_s: float) -> None:
    """Half-close after a refusal, then read and drop what the peer still sends (bounded
    in bytes and time), so that it reads our reply instead of a reset."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_WR)
        scratch = memoryview(bytearray(RECV_BUFFER_BYTES))
        left, deadline = LINGER_BYTES, time.monotonic() + timeout_s
        while left > 0 and time.monotonic() < deadline:
            k = conn.recv_into(scratch)
            if k == 0:
                return
            left -= k
