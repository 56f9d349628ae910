"""A large READ reply of the tcp transport lands straight in its destination: the initiator
polls for the reply header only, and the payload never passes through the connection's
receive buffer (issue 16: no copy of a 64 KiB get's bytes). A socket pair and a thread
that answers in the transport's wire format stand in for the target."""

from __future__ import annotations

import socket
import threading
import zlib

import numpy as np
import pytest

from pymooncake.transfer.batch import StatusCode, TransferOp
from pymooncake.transfer.transports.base import Slice
from pymooncake.transfer.transports.tcp import run_window
from pymooncake.transfer.transports.wire import (
    REP,
    REP_MAGIC,
    REQ,
    ST_INVALID,
    ST_OK,
    TcpConnection,
)


def _answer(sock: socket.socket, payload: bytes, status: int = ST_OK, msg: bytes = b"") -> None:
    """Read one request header; answer it with ``status`` (and the payload when OK)."""
    req = b""
    while len(req) < REQ.size:
        req += sock.recv(REQ.size - len(req))
    _, _, _, _, seq, _, length, _ = REQ.unpack(req)
    if status == ST_OK:
        sock.sendall(REP.pack(REP_MAGIC, ST_OK, 1, 0, seq, length, zlib.crc32(payload))
                     + payload)
    else:
        sock.sendall(REP.pack(REP_MAGIC, status, 0, len(msg), seq, 0, 0) + msg)


@pytest.mark.parametrize("size", [32 * 1024, 64 * 1024, 200 * 1024])
def test_large_read_reply_bypasses_the_receive_buffer(size: int) -> None:
    a, b = socket.socketpair()
    try:
        conn = TcpConnection(a)
        payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
        dst = np.zeros(size, dtype=np.uint8)
        t = threading.Thread(target=_answer, args=(b, payload))
        t.start()
        s = Slice(TransferOp.READ, dst.ctypes.data, 0, size, 0, 0, view=memoryview(dst))
        assert run_window(conn, [s], True, 7, poll_s=0.5) == [(StatusCode.OK, "")]
        t.join()
        assert dst.tobytes() == payload
        # only the header went through the buffer; none of the payload's bytes did
        buf = bytes(conn.reader._buf)
        assert payload[:64] not in buf
        assert conn.reader.empty
        # an error reply after a large READ's header poll still reads its message
        t = threading.Thread(target=_answer, args=(b, b"", ST_INVALID, b"out of range"))
        t.start()
        assert run_window(conn, [s], True, 8, poll_s=0.5) == [
            (StatusCode.INVALID_ARGUMENT, "out of range")]
        t.join()
    finally:
        a.close()
        b.close()
