"""The tcp transport's wire: header formats, buffered exact reads, gathered sends.

Per wire request (a slice, or a run of contiguous slices of one request: ``tcp.runs``)
the initiator sends a 36-byte request header, followed for a WRITE by the payload; the
target answers a 28-byte reply header, followed for a READ by the payload::

    request  !4s B  B     H   Q    Q     Q      I
             PMTQ op flags 0  seq  addr  length crc32
    reply    !4s B      B     H        Q    Q      I      + message (msg_len bytes)
             PMTR status flags msg_len seq  length crc32  (+ payload for an OK READ)

Request flags: ``FLAG_CRC`` (crc32 of the payload is checked), ``FLAG_MORE`` (more
requests of this window follow: the target may hold its replies). Reply flags:
``FLAG_CRC``, ``FLAG_CLOSING`` (the target refused this slice and ends the session).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from collections.abc import Sequence

from pymooncake.rpc.client import poll_recv
from pymooncake.transfer.batch import StatusCode

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
FLAG_CLOSING = 4
"""On a reply: the target refused this slice and closes the session after it."""
MAX_IOV = 512
SERVER_MAX_SLICE_BYTES = 64 * 1024 * 1024
ADDR_LIMIT = 1 << 64
LINGER_BYTES = SERVER_MAX_SLICE_BYTES + 2 * RECV_BUFFER_BYTES


def recv_exact_into(sock: socket.socket, view: memoryview,
                    deadline: float | None = None) -> None:
    """Fill ``view`` from ``sock``; ``ConnectionError`` when the peer closes first,
    ``TimeoutError`` when ``deadline`` (``time.monotonic()``) passes first.

    On a blocking socket (the target side) ``MSG_WAITALL`` lets the kernel fill the whole
    view in one call, without the GIL; with a timeout set Python polls, so it loops.
    """
    flags = socket.MSG_WAITALL if sock.gettimeout() is None else 0
    while view.nbytes:
        n = sock.recv_into(view, 0, flags)
        if n == 0:
            raise ConnectionError("peer closed the connection")
        view = view[n:]
        if view.nbytes and deadline is not None and time.monotonic() > deadline:
            raise TimeoutError("request not received in time")


class RecvBuffer:
    """Buffered exact reads from a socket; large reads bypass the buffer (zero copy)."""

    def __init__(self, sock: socket.socket, size: int = RECV_BUFFER_BYTES) -> None:
        self.sock = sock
        self._buf = bytearray(size)
        self._mv = memoryview(self._buf)
        self._start = 0
        self._end = 0

    def read_into(self, view: memoryview, deadline: float | None = None) -> None:
        """Fill ``view``; ``ConnectionError`` when the peer closes first, ``TimeoutError``
        when ``deadline`` (``time.monotonic()``) passes first."""
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
            recv_exact_into(self.sock, rest, deadline)
            return
        while self._end < rest.nbytes:
            k = self.sock.recv_into(self._mv[self._end:])
            if k == 0:
                raise ConnectionError("peer closed the connection")
            self._end += k
            if (self._end < rest.nbytes and deadline is not None
                    and time.monotonic() > deadline):
                raise TimeoutError("request not received in time")
        rest[:] = self._mv[:rest.nbytes]
        self._start = rest.nbytes

    def read_struct(self, st: struct.Struct, deadline: float | None = None) -> tuple:
        """The next ``st.size`` bytes unpacked (straight out of the buffer when they are
        there: the common case for headers)."""
        size = st.size
        start = self._start
        if self._end - start >= size:
            self._start = start + size
            return st.unpack_from(self._buf, start)
        out = bytearray(size)
        self.read_into(memoryview(out), deadline)
        return st.unpack_from(out)

    def poll(self, budget_s: float, limit: int = 0) -> None:
        """Wait up to ``budget_s`` for the next bytes by polling the socket (the CPU handed
        to any other runnable thread between two polls) before a read would sleep in the
        kernel: a reply that comes quickly finds this thread awake, and a peer on another
        CPU need not wake it (in a VM a cross-CPU wake-up costs tens of µs). No effect
        when bytes are buffered already or ``budget_s <= 0``; ``ConnectionError`` when the
        peer closed. ``limit``: take at most this many bytes now (a reply header whose
        large payload is then received straight into its destination, not through this
        buffer: no copy)."""
        if self._start != self._end or budget_s <= 0:
            return
        recv_into, mv = self.sock.recv_into, self._mv
        k = poll_recv(lambda: recv_into(mv, limit, socket.MSG_DONTWAIT), budget_s)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        if k is not None:
            self._start, self._end = 0, k

    def wait_readable(self) -> bool:
        """Block (without a deadline) until bytes arrive; ``False`` when the peer closed.

        For an idle connection between requests: a receive timeout (``SO_RCVTIMEO``)
        only means nothing was sent, so it waits on.
        """
        while True:
            try:
                k = self.sock.recv_into(self._mv)
            except BlockingIOError:
                continue
            if k == 0:
                return False
            self._start, self._end = 0, k
            return True

    @property
    def empty(self) -> bool:
        return self._start == self._end

class TcpConnection:
    """A pooled initiator-side connection: the socket and its receive buffer."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = RecvBuffer(sock)
        self.closed_by_peer = False
        """The target refused a slice and closed the session: do not pool it again."""
        self.idle_since = 0.0
        """``time.monotonic()`` when it last went back to the pool (``tcp.is_stale``)."""

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




def timeval(seconds: float) -> bytes:
    """``struct timeval`` for ``SO_RCVTIMEO``/``SO_SNDTIMEO``."""
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))
