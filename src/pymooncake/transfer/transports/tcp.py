"""``tcp`` transport: a framed binary protocol straight between registered buffers.

Per slice the initiator sends a 36-byte request header, followed for a WRITE by the
payload (``sendmsg`` of memoryviews over the registered memory: no intermediate bytes);
the target ``recv_into``s the payload straight into its registered range and answers a
28-byte reply header (followed for a READ by the payload, received straight into the
initiator's registered range)::

    request  !4s B  B     H   Q    Q     Q      I
             PMTQ op flags 0  seq  addr  length crc32
    reply    !4s B      B     H        Q    Q      I      + message (msg_len bytes)
             PMTR status flags msg_len seq  length crc32  (+ payload for an OK READ)

The target checks every slice against its own registered ranges and refuses one outside
them with ``INVALID_ARGUMENT`` (draining a WRITE's payload into scratch space, never into
its memory). A window of slices is pipelined: all requests are sent, then all replies read;
every request but the window's last carries ``FLAG_MORE`` so the target may hold its
replies (up to ``REPLY_FLUSH_BYTES``) and send them with one ``sendmsg``. Both ends read
through a :class:`RecvBuffer`: small headers and payloads come out of one ``recv``, large
payloads are received straight into the registered memory.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable, Sequence

from pymooncake.obs.logging import init_logger
from pymooncake.transfer.batch import StatusCode, TransferOp
from pymooncake.transfer.memory import MemoryRegistry, view_at
from pymooncake.transfer.transports.base import PathError, Slice

logger = init_logger(__name__)

REQ = struct.Struct("!4sBBHQQQI")
REP = struct.Struct("!4sBBHQQI")
REQ_MAGIC = b"PMTQ"
REP_MAGIC = b"PMTR"
FLAG_CRC = 1
FLAG_MORE = 2
REPLY_FLUSH_BYTES = 256 * 1024
RECV_BUFFER_BYTES = 64 * 1024
"""Read-ahead of a connection; payloads of at least half of it bypass the buffer."""
ST_OK, ST_INVALID, ST_CRC, ST_INTERNAL = 0, 1, 2, 3
STATUS_CODES = {ST_OK: StatusCode.OK, ST_INVALID: StatusCode.INVALID_ARGUMENT,
                ST_CRC: StatusCode.CHECKSUM_MISMATCH, ST_INTERNAL: StatusCode.INTERNAL}
MAX_IOV = 512
SERVER_MAX_SLICE_BYTES = 64 * 1024 * 1024


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ``ConnectionError`` when the peer closes first.

    On a blocking socket (the target side) ``MSG_WAITALL`` lets the kernel fill the whole
    view in one call, without the GIL; with a timeout set Python polls, so it loops.
    """
    flags = socket.MSG_WAITALL if sock.gettimeout() is None else 0
    while view.nbytes:
        n = sock.recv_into(view, 0, flags)
        if n == 0:
            raise ConnectionError("peer closed the connection")
        view = view[n:]


class RecvBuffer:
    """Buffered exact reads from a socket; large reads bypass the buffer (zero copy)."""

    def __init__(self, sock: socket.socket, size: int = RECV_BUFFER_BYTES) -> None:
        self.sock = sock
        self._buf = bytearray(size)
        self._mv = memoryview(self._buf)
        self._start = 0
        self._end = 0

    def read_into(self, view: memoryview) -> None:
        """Fill ``view``; ``ConnectionError`` when the peer closes first."""
        n = view.nbytes
        avail = self._end - self._start
        if avail >= n:
            view[:] = self._mv[self._start:self._start + n]
            self._start += n
            return
        if avail:
            view[:avail] = self._mv[self._start:self._end]
        self._start = self._end = 0
        rest = view[avail:]
        if rest.nbytes >= len(self._buf) // 2:
            recv_exact_into(self.sock, rest)
            return
        while self._end < rest.nbytes:
            k = self.sock.recv_into(self._mv[self._end:])
            if k == 0:
                raise ConnectionError("peer closed the connection")
            self._end += k
        rest[:] = self._mv[:rest.nbytes]
        self._start = rest.nbytes

    def discard(self, n: int) -> None:
        """Read and drop ``n`` bytes."""
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n:
            k = min(n, scratch.nbytes)
            self.read_into(scratch[:k])
            n -= k

    @property
    def empty(self) -> bool:
        return self._start == self._end


class TcpConnection:
    """A pooled initiator-side connection: the socket and its receive buffer."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = RecvBuffer(sock)

    def close(self) -> None:
        """Shut the socket down (waking a thread blocked on it) and close it."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


def _drop_sent(pending: list[memoryview], n: int) -> None:
    """Remove the first ``n`` sent bytes from the front of ``pending``."""
    while n:
        first = pending[0]
        if n >= first.nbytes:
            n -= first.nbytes
            pending.pop(0)
        else:
            pending[0] = first[n:]
            n = 0


def sendmsg_all(sock: socket.socket, bufs: Sequence[memoryview | bytes]) -> None:
    """Send every buffer with as few ``sendmsg`` calls as the kernel allows."""
    if len(bufs) <= MAX_IOV:  # usually one call sends everything
        total = 0
        for b in bufs:
            total += len(b)
        n = sock.sendmsg(bufs)
        if n == total:
            return
        pending = [memoryview(b) for b in bufs if len(b)]
        _drop_sent(pending, n)
    else:
        pending = [memoryview(b) for b in bufs if len(b)]
    while pending:
        _drop_sent(pending, sock.sendmsg(pending[:MAX_IOV]))


# ---------------------------------------------------------------------------- target side
class TcpDataServer:
    """Serves slices into/out of ``registry`` on ``host:port`` (one thread per connection).

    ``fault_drop_after_slices`` (tests only): after that many slices on one connection,
    the server closes that connection in the middle of the next slice, once.
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
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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
        hdr = bytearray(REQ.size)
        hview = memoryview(hdr)
        reader = RecvBuffer(conn)
        pending: list[memoryview | bytes] = []
        pending_bytes = 0
        num_slices = 0
        try:
            while True:
                try:
                    reader.read_into(hview)
                except ConnectionError:
                    return
                magic, op, flags, _, seq, addr, length, crc = REQ.unpack_from(hdr)
                if magic != REQ_MAGIC or op not in (0, 1) or length > SERVER_MAX_SLICE_BYTES:
                    logger.warning("tcp data server: malformed request header; closing link")
                    return
                num_slices += 1
                if (self.fault_drop_after_slices is not None
                        and num_slices > self.fault_drop_after_slices):
                    self.fault_drop_after_slices = None
                    logger.warning("tcp data server: injected fault, dropping connection")
                    return
                region = self.registry.find(addr, length)
                if region is None:
                    msg = (f"target range [{addr:#x}, {addr + length:#x}) is outside every "
                           "registered buffer of this segment").encode()
                    if op == TransferOp.WRITE:  # drain the payload, never into our memory
                        reader.discard(length)
                    reply = [REP.pack(REP_MAGIC, ST_INVALID, 0, len(msg), seq, 0, 0) + msg]
                else:
                    view = view_at(addr, length)
                    if op == TransferOp.WRITE:
                        reader.read_into(view)
                        status = ST_OK
                        if flags & FLAG_CRC and zlib.crc32(view) != crc:
                            status = ST_CRC
                        reply = [REP.pack(REP_MAGIC, status, 0, 0, seq, 0, 0)]
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
        except OSError as e:
            logger.debug("tcp data server: connection ended: %r", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._conn_threads.discard(threading.current_thread())
            with contextlib.suppress(OSError):
                conn.close()

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


# ------------------------------------------------------------------------- initiator side
def open_connection(host: str, port: int, connect_timeout_s: float,
                    io_timeout_s: float, source_ip: str | None = None) -> TcpConnection:
    """A connected, ``TCP_NODELAY`` connection whose every send/recv times out; bound to
    ``source_ip`` (a device's address: the path's NIC) when given."""
    sock = socket.create_connection((host, port), timeout=connect_timeout_s,
                                    source_address=(source_ip, 0) if source_ip else None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(io_timeout_s)
    return TcpConnection(sock)


def is_stale(conn: TcpConnection) -> bool:
    """True when an idle pooled connection was closed by the peer (EOF or error pending).

    An idle connection of this protocol has nothing to read, so readability means the
    peer closed or reset it.
    """
    if not conn.reader.empty:
        return True
    try:
        readable, _, _ = select.select([conn.sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def run_window(conn: TcpConnection, slices: Sequence[Slice], checksum: bool,
               first_seq: int) -> list[tuple[StatusCode, str]]:
    """Send a window of slices and read their replies in order.

    Returns one ``(code, message)`` per slice (a refusal by the target is a result, not a
    path error). Raises :class:`PathError` when the link breaks, with how many slices
    completed before it.
    """
    sock, reader = conn.sock, conn.reader
    last = len(slices) - 1
    bufs: list[memoryview | bytes] = []
    for i, s in enumerate(slices):
        flags = (FLAG_CRC if checksum else 0) | (FLAG_MORE if i < last else 0)
        if s.op is TransferOp.WRITE:
            view = view_at(s.local_addr, s.length)
            crc = zlib.crc32(view) if checksum else 0
            bufs.append(REQ.pack(REQ_MAGIC, 1, flags, 0, first_seq + i, s.target_addr,
                                 s.length, crc))
            bufs.append(view)
        else:
            bufs.append(REQ.pack(REQ_MAGIC, 0, flags, 0, first_seq + i, s.target_addr,
                                 s.length, 0))
    results: list[tuple[StatusCode, str]] = []
    hdr = bytearray(REP.size)
    try:
        sendmsg_all(sock, bufs)
        for i, s in enumerate(slices):
            reader.read_into(memoryview(hdr))
            magic, status, _, msg_len, seq, length, crc = REP.unpack_from(hdr)
            if magic != REP_MAGIC or seq != first_seq + i:
                raise ConnectionError("reply out of sequence (corrupted link)")
            msg = ""
            if msg_len:
                mbuf = bytearray(msg_len)
                reader.read_into(memoryview(mbuf))
                msg = mbuf.decode(errors="replace")
            if status == ST_OK and s.op is TransferOp.READ:
                if length != s.length:
                    raise ConnectionError("reply length differs from the request")
                view = view_at(s.local_addr, s.length)
                reader.read_into(view)
                if checksum and zlib.crc32(view) != crc:
                    status, msg = ST_CRC, "checksum mismatch on read"
            code = STATUS_CODES.get(status, StatusCode.INTERNAL)
            if code is StatusCode.CHECKSUM_MISMATCH and not msg:
                msg = "checksum mismatch on write"
            results.append((code, msg))
    except TimeoutError as e:
        raise PathError(f"timed out: {e}", results, StatusCode.TIMEOUT) from e
    except OSError as e:  # ConnectionError, reset, broken pipe, closed socket
        raise PathError(f"connection error: {e!r}", results,
                        StatusCode.CONNECTION_ERROR) from e
    return results
