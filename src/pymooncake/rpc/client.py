"""``SyncRpcClient``: the blocking RPC client, and its polled wait for answers.

It connects on first use and reconnects on the next call after the connection is lost;
to a loopback address it connects over the server's same-host Unix socket when there is
one (``rpc.local``), else over TCP.
Every call has a timeout (``timeout_s``, seconds). A call that times out or loses its
connection raises ``RpcTimeout`` / ``RpcConnectionError``; the request may or may not
have run on the server, so callers retry only idempotent methods. The asyncio
counterpart is ``rpc.async_client.RpcClient``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from pymooncake.rpc import local
from pymooncake.rpc.codec import HEADER, MAX_FRAME_BYTES, Reply, pack_frame
from pymooncake.rpc.errors import RpcConnectionError, RpcTimeout
from pymooncake.rpc.replies import reply_of, result_of

T = TypeVar("T")

REPLY_POLL_S = 50e-6
"""How long ``SyncRpcClient`` polls for an answer before its receive sleeps (the least;
see ``REPLY_POLL_MAX_S``)."""

REPLY_POLL_MAX_S = 300e-6
"""Longest poll for an answer (s). While this client's recent answers come within this
(the running mean ``SyncRpcClient.rtt_s``), it polls four times that mean (at least ``poll_s``,
at most this): a server that queues calls from several clients answers after the others'
calls, later than ``REPLY_POLL_S``, and a caller already asleep by then makes the server's
send wake it — a cross-CPU wake-up that on a VM's CPUs costs the server more than the call
(issue 16: the master's ``remove`` answers, 4 clients). Slower answers get ``poll_s`` only
(the sleep is cheap beside them). 0: no adaptation. Read at each call."""


def poll_recv(recv: Callable[[], T], budget_s: float) -> T | None:
    """``recv()`` — a non-blocking receive (``MSG_DONTWAIT``) — retried until it returns or
    ``budget_s`` seconds have passed (then ``None``), the CPU handed to any other runnable
    thread between two tries: an answer that comes quickly finds the caller awake instead
    of waking it (a cross-CPU wake-up costs tens of µs on a VM's CPUs). Used before a
    blocking receive by the Transfer Engine's tcp paths (inlined in ``SyncRpcClient``)."""
    end = time.monotonic() + budget_s
    while True:
        try:
            return recv()
        except BlockingIOError:
            if time.monotonic() >= end:
                return None
            os.sched_yield()


LOOK_FIRST_S = 25e-6
"""``SyncRpcClient`` looks for the answer at once when its call has been out this long (s,
from the send; its thread lost the CPU meanwhile), else hands the CPU over first."""

_DONTWAIT = socket.MSG_DONTWAIT


class SyncRpcClient:
    """Blocking client for threads without an event loop; thread-safe (one call at a time).

    The socket blocks in the kernel with ``SO_RCVTIMEO``/``SO_SNDTIMEO`` as the timeout
    (not Python's socket timeout, which polls before every send and receive: two more
    system calls per call on the hot path of every Store operation). After a timeout or a
    lost connection the socket is dropped (a late response would desynchronise it) and the
    next call reconnects.
    """

    def __init__(self, host: str, port: int, timeout_s: float = 5.0,
                 poll_s: float = REPLY_POLL_S) -> None:
        if timeout_s <= 0 or not 0 <= poll_s <= 1:
            raise ValueError(f"need timeout_s > 0 and 0 <= poll_s <= 1, got {timeout_s} and "
                             f"{poll_s}")
        self.host, self.port = host, port
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._sock: socket.socket | None = None
        self._sock_timeout = 0.0  # the SO_RCVTIMEO/SO_SNDTIMEO set on _sock
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._buf = bytearray()
        self._sent_at = 0.0  # time.monotonic() just before the last request's send
        self.rtt_s = 0.0
        """Running mean (1/8 weight to the newest) of the answer time of ``call``s: send
        to answer, s; 0 before the first. Sets the poll budget (``REPLY_POLL_MAX_S``)."""

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = self._connect_unix()
            if sock is None:
                try:
                    sock = socket.create_connection((self.host, self.port),
                                                    timeout=self.timeout_s)
                except OSError as e:
                    raise RpcConnectionError(
                        f"cannot connect to {self.host}:{self.port}: {e}") from e
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(None)  # blocking; the timeout is the kernel's (_set_timeout)
            self._sock = sock
            self._sock_timeout = 0.0
            self._buf.clear()
        return self._sock

    def _connect_unix(self) -> socket.socket | None:
        """A connection to the server's same-host Unix socket (``rpc.local``), or ``None``
        (then TCP): not a loopback target, turned off, or every connect failed or took
        over ``timeout_s`` seconds (nothing listening, a full backlog)."""
        for name in local.client_names(self.host, self.port):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(self.timeout_s)
                sock.connect(name)
                return sock
            except OSError:
                sock.close()
        return None

    def _set_timeout(self, sock: socket.socket, timeout: float) -> None:
        if timeout != self._sock_timeout:
            sec = int(timeout)
            usec = int((timeout - sec) * 1e6)
            tv = struct.pack("ll", sec, usec if sec or usec else 1)  # 0 would mean "never"
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            self._sock_timeout = timeout

    def _drop(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self._sock = None
        self._buf.clear()

    def poll_budget_s(self) -> float:
        """How long the next answer is polled for (s): ``poll_s``, or four times the running
        answer time ``rtt_s`` (at most ``REPLY_POLL_MAX_S``) while that is within
        ``REPLY_POLL_MAX_S``. 0 when polling is off (``poll_s`` 0)."""
        base, rtt, cap = self.poll_s, self.rtt_s, REPLY_POLL_MAX_S
        if not base or not rtt or rtt > cap:
            return base
        return max(base, min(cap, 4.0 * rtt))

    def _poll(self, sock: socket.socket, want: int) -> bytes | None:
        """Up to ``want`` bytes of the answer polled for ``poll_budget_s()``, or ``None``
        (then the receive sleeps). Adaptive (issue 16): a look that finds nothing costs a
        system call and an exception, so the CPU is handed over (to the server) before the
        first look unless the call has been out ``LOOK_FIRST_S`` already."""
        end = (now := time.monotonic()) + self.poll_budget_s()
        if now - self._sent_at < LOOK_FIRST_S:
            os.sched_yield()
        while True:
            try:
                return sock.recv(want, _DONTWAIT)
            except BlockingIOError:
                if time.monotonic() >= end:
                    return None
                os.sched_yield()

    def _read_msg(self, sock: socket.socket) -> Reply:
        """The next frame's response envelope (usually one ``recv``: the whole response),
        polled for up to ``poll_s`` before the receive sleeps (``_poll``)."""
        buf = self._buf
        hsize = HEADER.size
        poll = self.poll_s > 0
        while True:
            want = 65536
            if len(buf) >= hsize:
                (length,) = HEADER.unpack_from(buf)
                if length > MAX_FRAME_BYTES:
                    raise ConnectionError(f"server sent a frame of {length} bytes")
                end = hsize + length
                if len(buf) >= end:
                    body = bytes(buf[hsize:end])
                    del buf[:end]
                    return reply_of(body)
                want = max(want, end - len(buf))
            chunk = self._poll(sock, want) if poll else None
            poll = False  # once a frame: then the receive sleeps
            if chunk is None:
                chunk = sock.recv(want)
            if not chunk:
                raise ConnectionError("connection closed by the server")
            if not buf and len(chunk) >= hsize:  # the common case: exactly one frame
                (length,) = HEADER.unpack_from(chunk)
                if length <= MAX_FRAME_BYTES and len(chunk) == hsize + length:
                    return reply_of(memoryview(chunk)[hsize:])
            buf += chunk

    def call(self, method: str, params: Any = None, timeout_s: float | None = None,
             reply_type: Any = None) -> Any:
        """Call ``method`` and block for its result (see ``RpcClient.call``)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            try:
                sock, rid = self._send(method, params, timeout)
                out = self._result(sock, rid, reply_type)
            except BaseException as e:
                self._failed(method, timeout, e)
                raise
            # answer time of a plain call (not ``begin``'s: the caller works in between)
            dt = time.monotonic() - self._sent_at
            rtt = self.rtt_s
            self.rtt_s = dt if not rtt else rtt + (dt - rtt) * 0.125
            return out

    def begin(self, method: str, params: Any = None, timeout_s: float | None = None
              ) -> Callable[..., Any]:
        """Send a call now and return ``finish(reply_type=None)``, which blocks for its
        result as ``call`` would; in between the caller may do other work (a Store get
        reads the bytes while the master answers). The client is held until ``finish``
        is called, which the caller must do exactly once on every path. Raises as
        ``call`` when the request cannot be sent."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        self._lock.acquire()
        try:
            sock, rid = self._send(method, params, timeout)
        except BaseException as e:
            try:
                self._failed(method, timeout, e)
            finally:
                self._lock.release()
            raise

        def finish(reply_type: Any = None) -> Any:
            try:
                return self._result(sock, rid, reply_type)
            except BaseException as e:
                self._failed(method, timeout, e)
                raise
            finally:
                self._lock.release()

        return finish

    def _send(self, method: str, params: Any, timeout: float) -> tuple[socket.socket, int]:
        """Send one request (the lock held); its socket and id."""
        sock = self._sock or self._connect()
        rid = next(self._ids)
        if timeout != self._sock_timeout:
            self._set_timeout(sock, timeout)
        self._sent_at = time.monotonic()
        sock.sendall(pack_frame({"i": rid, "m": method, "p": params}))
        return sock, rid

    def _result(self, sock: socket.socket, rid: int, reply_type: Any) -> Any:
        """The result of request ``rid`` (the lock held), or the ``RpcError`` it carries."""
        while True:
            msg = self._read_msg(sock)
            if msg.i == rid:
                return result_of(msg, reply_type)

    def _failed(self, method: str, timeout: float, e: BaseException) -> None:
        """For a timeout or a connection's error ``e``: drop the socket (a late response
        would desynchronise it) and raise ``RpcTimeout``/``RpcConnectionError``; return
        for any other exception (the caller re-raises it)."""
        if isinstance(e, TimeoutError | BlockingIOError):
            self._drop()
            raise RpcTimeout(f"{method} to {self.host}:{self.port}: no response in "
                             f"{timeout:.3g} s") from None
        if isinstance(e, OSError | ValueError):
            self._drop()
            raise RpcConnectionError(f"{method} to {self.host}:{self.port}: {e}") from e

    def close(self) -> None:
        with self._lock:
            self._drop()
