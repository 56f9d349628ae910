"""``tcp`` transport: a framed binary protocol straight between registered buffers.

Per wire request — a slice, or a run of contiguous slices of one request that a path
took together (``runs``) — the initiator sends a 36-byte request header, followed for a
WRITE by the payload (``sendmsg`` of memoryviews over the registered memory: no intermediate bytes);
the target ``recv_into``s the payload straight into its registered range and answers a
28-byte reply header (followed for a READ by the payload, received straight into the
initiator's registered range)::

    request  !4s B  B     H   Q    Q     Q      I
             PMTQ op flags 0  seq  addr  length crc32
    reply    !4s B      B     H        Q    Q      I      + message (msg_len bytes)
             PMTR status flags msg_len seq  length crc32  (+ payload for an OK READ)

The target (``tcp_server.py``) checks every slice against its own registered ranges and
refuses one outside them with ``INVALID_ARGUMENT``, then ends that session (BUG-64); the
initiator re-sends the rest of that window on a fresh connection. The wire format lives
in ``wire.py``. A window of slices is pipelined: all requests are sent, then all replies read;
every request but the window's last carries ``FLAG_MORE`` so the target may hold its
replies (up to ``REPLY_FLUSH_BYTES``) and send them with one ``sendmsg``. Both ends read
through a :class:`RecvBuffer`: small headers and payloads come out of one ``recv``, large
payloads are received straight into the registered memory.
"""

from __future__ import annotations

import select
import socket
import time
import zlib
from collections.abc import Sequence

from pymooncake.transfer.batch import StatusCode, TransferOp
from pymooncake.transfer.memory import view_at
from pymooncake.transfer.transports.base import PathError, Slice
from pymooncake.transfer.transports.tcp_server import TcpDataServer
from pymooncake.transfer.transports.wire import (
    FLAG_CLOSING,
    FLAG_CRC,
    FLAG_MORE,
    RECV_BUFFER_BYTES,
    REP,
    REP_MAGIC,
    REQ,
    REQ_MAGIC,
    SERVER_MAX_SLICE_BYTES,
    ST_CRC,
    ST_OK,
    STATUS_CODES,
    RecvBuffer,
    TcpConnection,
    sendmsg_all,
    timeval,
)

_OK = (StatusCode.OK, "")

__all__ = ["TcpConnection", "TcpDataServer", "is_stale", "open_connection", "run_window"]

def open_connection(host: str, port: int, connect_timeout_s: float,
                    io_timeout_s: float, source_ip: str | None = None) -> TcpConnection:
    """A connected, ``TCP_NODELAY`` connection whose every send/recv times out; bound to
    ``source_ip`` (a device's address: the path's NIC) when given.

    The socket stays in blocking mode with kernel timeouts (``SO_RCVTIMEO``,
    ``SO_SNDTIMEO``) rather than Python's (which make every call a ``poll`` plus a
    non-blocking call and rule out ``MSG_WAITALL``): a payload is sent or received in one
    system call without the GIL. A call that times out raises ``BlockingIOError``.
    """
    sock = socket.create_connection((host, port), timeout=connect_timeout_s,
                                    source_address=(source_ip, 0) if source_ip else None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(None)
    tv = timeval(io_timeout_s)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    return TcpConnection(sock)


STALE_CHECK_IDLE_S = 0.01
"""A pooled connection idle for less than this (s) is reused without ``is_stale``'s look."""


def is_stale(conn: TcpConnection, min_idle_s: float | None = None) -> bool:
    """True when an idle pooled connection was closed by the peer (EOF or error pending).

    An idle connection of this protocol has nothing to read, so readability means the
    peer closed or reset it. One back in the pool for less than ``min_idle_s`` (default
    ``STALE_CHECK_IDLE_S``; since ``conn.idle_since``) is taken as live without looking:
    the look is a system call and a GIL hand-off a window (at 4 KiB x 128, ~2 % of the
    throughput). A peer that closed it that recently fails the window, which goes again
    at once on a fresh connection as a connection that breaks during a window does
    (``paths.TcpPaths._run_window``, BUG-36; its slices count one retry).
    """
    limit = STALE_CHECK_IDLE_S if min_idle_s is None else min_idle_s
    if time.monotonic() - conn.idle_since < limit:
        return False
    if not conn.reader.empty:
        return True
    try:
        readable, _, _ = select.select([conn.sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def runs(slices: Sequence[Slice], max_bytes: int = SERVER_MAX_SLICE_BYTES
         ) -> list[tuple[int, int, int]]:
    """``[(first, count, length), ...]``: the window cut into wire requests. Consecutive
    slices of one request that continue each other on both ends (the path took them
    together) travel as one request whose payload is their views in a row, up to
    ``max_bytes``: the slices stay the unit of path choice and retry (DESIGN.md §4), the
    wire pays its per-request cost (a header, a reply, a target's turn) once a run."""
    out: list[tuple[int, int, int]] = []
    prev: Slice | None = None
    for i, s in enumerate(slices):
        if (prev is not None and s.op is prev.op and s.request_index == prev.request_index
                and s.batch_id == prev.batch_id
                and s.local_addr == prev.local_addr + prev.length
                and s.target_addr == prev.target_addr + prev.length
                and out[-1][2] + s.length <= max_bytes):
            first, count, length = out[-1]
            out[-1] = (first, count + 1, length + s.length)
        else:
            out.append((i, 1, s.length))
        prev = s
    return out


def run_window(conn: TcpConnection, slices: Sequence[Slice], checksum: bool,
               first_seq: int, poll_s: float = 0.0) -> list[tuple[StatusCode, str]]:
    """Send a window of slices and read their replies in order (polling for the first
    reply up to ``poll_s`` before sleeping: ``RecvBuffer.poll``). Contiguous slices of
    one request go as one wire request (``runs``); a window of small requests, each its
    own slice (the usual case), goes slice by slice without that cut.

    Returns one ``(code, message)`` per slice (a refusal by the target is a result, not a
    path error; a run's answer is each of its slices'). Raises :class:`PathError` when
    the link breaks, with how many slices completed before it.
    """
    n = len(slices)
    if n > 1 and len({s.request_index for s in slices}) < n:  # a request split here
        cut = runs(slices)
        if len(cut) < n:
            return _run_cut(conn, slices, cut, checksum, first_seq, poll_s)
    return _run_slices(conn, slices, checksum, first_seq, poll_s)


def _refused(conn: TcpConnection, status: int, rflags: int, msg: str, count: int,
             more: bool, results: list[tuple[StatusCode, str]]) -> bool:
    """Record a wire request's failed answer for its ``count`` slices; True when the target
    closed the session with it (the window ends; ``PathError(refused=True)`` when ``more``
    requests of the window were sent)."""
    code = STATUS_CODES.get(status, StatusCode.INTERNAL)
    if code is StatusCode.CHECKSUM_MISMATCH and not msg:
        msg = "checksum mismatch on write"
    results.extend([(code, msg)] * count)
    if rflags & FLAG_CLOSING and status != ST_OK:
        conn.closed_by_peer = True
        if more:  # the rest of the window must go on another connection
            raise PathError("the target closed the session after refusing a slice",
                            results, StatusCode.CONNECTION_ERROR, refused=True)
        return True
    return False


def _reply_msg(reader: RecvBuffer, msg_len: int) -> str:
    if not msg_len:
        return ""
    mbuf = bytearray(msg_len)
    reader.read_into(memoryview(mbuf))
    return mbuf.decode(errors="replace")


def _run_slices(conn: TcpConnection, slices: Sequence[Slice], checksum: bool,
                first_seq: int, poll_s: float) -> list[tuple[StatusCode, str]]:
    """``run_window``, one wire request per slice."""
    sock, reader = conn.sock, conn.reader
    last = len(slices) - 1
    bufs: list[memoryview | bytes] = []
    for i, s in enumerate(slices):
        flags = (FLAG_CRC if checksum else 0) | (FLAG_MORE if i < last else 0)
        if s.op is TransferOp.WRITE:
            view = s.view if s.view is not None else view_at(s.local_addr, s.length)
            crc = zlib.crc32(view) if checksum else 0
            bufs.append(REQ.pack(REQ_MAGIC, 1, flags, 0, first_seq + i, s.target_addr,
                                 s.length, crc))
            bufs.append(view)
        else:
            bufs.append(REQ.pack(REQ_MAGIC, 0, flags, 0, first_seq + i, s.target_addr,
                                 s.length, 0))
    results: list[tuple[StatusCode, str]] = []
    try:
        sendmsg_all(sock, bufs)
        # a large READ first: poll for its header only, the payload then lands straight
        # in the destination (RecvBuffer.read_into bypasses the buffer) instead of a
        # buffer-full being copied out of the receive buffer
        first = slices[0]
        reader.poll(poll_s, REP.size if first.op is TransferOp.READ
                    and first.length >= RECV_BUFFER_BYTES // 2 else 0)
        for i, s in enumerate(slices):
            magic, status, rflags, msg_len, seq, length, crc = reader.read_struct(REP)
            if magic != REP_MAGIC or seq != first_seq + i:
                raise ConnectionError("reply out of sequence (corrupted link)")
            msg = _reply_msg(reader, msg_len) if msg_len else ""
            if status == ST_OK and s.op is TransferOp.READ:
                if length != s.length:
                    raise ConnectionError("reply length differs from the request")
                view = s.view if s.view is not None else view_at(s.local_addr, s.length)
                reader.read_into(view)
                if checksum and zlib.crc32(view) != crc:
                    status, msg = ST_CRC, "checksum mismatch on read"
            if status == ST_OK and not msg:
                results.append(_OK)
            elif _refused(conn, status, rflags, msg, 1, i < last, results):
                break
    except (TimeoutError, BlockingIOError) as e:  # BlockingIOError: SO_RCVTIMEO/SNDTIMEO
        raise PathError(f"timed out: {e}", results, StatusCode.TIMEOUT) from e
    except OSError as e:  # ConnectionError, reset, broken pipe, closed socket
        raise PathError(f"connection error: {e!r}", results,
                        StatusCode.CONNECTION_ERROR) from e
    return results


def _run_cut(conn: TcpConnection, slices: Sequence[Slice], cut: list[tuple[int, int, int]],
             checksum: bool, first_seq: int, poll_s: float) -> list[tuple[StatusCode, str]]:
    """``run_window``, one wire request per run of ``cut`` (``runs``): a WRITE's payload is
    its slices' views in a row, a READ's reply payload is received into them in turn,
    and the CRC covers the run."""
    sock, reader = conn.sock, conn.reader
    views = [s.view if s.view is not None else view_at(s.local_addr, s.length)
             for s in slices]
    last = len(cut) - 1
    bufs: list[memoryview | bytes] = []
    for j, (first, count, length) in enumerate(cut):
        flags = (FLAG_CRC if checksum else 0) | (FLAG_MORE if j < last else 0)
        s, mine = slices[first], views[first:first + count]
        if s.op is TransferOp.WRITE:
            crc = 0
            if checksum:
                for v in mine:
                    crc = zlib.crc32(v, crc)
            bufs.append(REQ.pack(REQ_MAGIC, 1, flags, 0, first_seq + j, s.target_addr,
                                 length, crc))
            bufs.extend(mine)
        else:
            bufs.append(REQ.pack(REQ_MAGIC, 0, flags, 0, first_seq + j, s.target_addr,
                                 length, 0))
    results: list[tuple[StatusCode, str]] = []
    try:
        sendmsg_all(sock, bufs)
        reader.poll(poll_s, REP.size if slices[0].op is TransferOp.READ
                    and cut[0][2] >= RECV_BUFFER_BYTES // 2 else 0)
        for j, (first, count, length) in enumerate(cut):
            magic, status, rflags, msg_len, seq, rlength, crc = reader.read_struct(REP)
            if magic != REP_MAGIC or seq != first_seq + j:
                raise ConnectionError("reply out of sequence (corrupted link)")
            msg = _reply_msg(reader, msg_len)
            if status == ST_OK and slices[first].op is TransferOp.READ:
                if rlength != length:
                    raise ConnectionError("reply length differs from the request")
                got = 0
                for v in views[first:first + count]:
                    reader.read_into(v)
                    if checksum:
                        got = zlib.crc32(v, got)
                if checksum and got != crc:
                    status, msg = ST_CRC, "checksum mismatch on read"
            if status == ST_OK and not msg:
                results.extend([_OK] * count)
            elif _refused(conn, status, rflags, msg, count, j < last, results):
                break
    except (TimeoutError, BlockingIOError) as e:
        raise PathError(f"timed out: {e}", results, StatusCode.TIMEOUT) from e
    except OSError as e:
        raise PathError(f"connection error: {e!r}", results,
                        StatusCode.CONNECTION_ERROR) from e
    return results
