"""``RpcClient``: the asyncio RPC client, many calls in flight on its one connection.

It connects on first use and reconnects on the next call after the connection is lost;
to a loopback address over the server's same-host Unix socket when there is one
(``rpc.local``), else over TCP.
Every call has a timeout (``timeout_s``, seconds). A call that times out or loses its
connection raises ``RpcTimeout`` / ``RpcConnectionError``; the request may or may not
have run on the server, so callers retry only idempotent methods. The blocking
counterpart is ``rpc.client.SyncRpcClient``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
from collections.abc import Callable
from typing import Any

from pymooncake.rpc import local
from pymooncake.rpc.codec import HEADER, MAX_FRAME_BYTES, pack_frame
from pymooncake.rpc.errors import RpcConnectionError, RpcTimeout
from pymooncake.rpc.replies import reply_of, result_of


class RpcClient:
    """Asyncio client; many calls may be in flight on its one connection.

    Use from one event loop. ``await call(method, params)`` returns the handler's result
    or raises ``RpcError`` (with the server's code), ``RpcTimeout`` or
    ``RpcConnectionError``.
    """

    def __init__(self, host: str, port: int, timeout_s: float = 5.0,
                 connect_timeout_s: float = 5.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.host, self.port = host, port
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._connect_lock: asyncio.Lock | None = None
        self.on_disconnect: Callable[[str], None] | None = None
        """Called (on the event loop, with the reason) when an open connection ends: lost,
        closed by the server or by ``close``. A service that expects one-way traffic from
        the peer on another connection learns from it that the peer is gone."""

    async def _ensure_connected(self) -> asyncio.StreamWriter:
        if self._writer is not None and not self._writer.is_closing():
            return self._writer
        if self._connect_lock is None:
            self._connect_lock = asyncio.Lock()
        async with self._connect_lock:
            if self._writer is not None and not self._writer.is_closing():
                return self._writer
            opened = await self._open_unix()  # same host: the server's Unix socket first
            if opened is None:
                try:
                    opened = await asyncio.wait_for(
                        asyncio.open_connection(self.host, self.port, limit=2**20),
                        self.connect_timeout_s)
                except (TimeoutError, OSError) as e:
                    raise RpcConnectionError(f"cannot connect to {self.host}:{self.port}: "
                                             f"{e or type(e).__name__}") from e
                sock = opened[1].get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            reader, writer = opened
            self._writer = writer
            self._reader_task = asyncio.ensure_future(self._read_loop(reader))
            return writer

    async def _open_unix(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """Streams to the server's same-host Unix socket (``rpc.local``), or ``None`` (then
        TCP): not a loopback target, turned off, or every connect failed, took over
        ``connect_timeout_s`` seconds, or left no connection (a full backlog: asyncio's
        connect reports success on a socket that is not connected)."""
        for name in local.client_names(self.host, self.port):
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_unix_connection(name, limit=2**20), self.connect_timeout_s)
            except (TimeoutError, OSError):
                continue
            sock = writer.get_extra_info("socket")
            try:
                if sock is not None and not writer.is_closing():
                    sock.getpeername()  # raises when the connect left no connection
                    return reader, writer
            except OSError:
                pass
            writer.close()
        return None

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        reason = "connection closed by the server"
        buf = bytearray()
        try:
            while True:
                data = await reader.read(1 << 18)
                if not data:
                    return
                buf += data
                pos = 0
                while len(buf) - pos >= HEADER.size:
                    (length,) = HEADER.unpack_from(buf, pos)
                    if length > MAX_FRAME_BYTES:
                        reason = f"server sent a frame of {length} bytes"
                        return
                    end = pos + HEADER.size + length
                    if len(buf) < end:
                        break
                    self._deliver(bytes(buf[pos + HEADER.size:end]))
                    pos = end
                if pos:
                    del buf[:pos]
        except ConnectionError as e:
            reason = f"connection lost: {e}"
        except asyncio.CancelledError:
            reason = "connection closed by the client"
            raise
        finally:
            if self._writer is not None:
                self._writer.close()
            self._writer = None
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(RpcConnectionError(
                        f"{self.host}:{self.port}: {reason}"))
            self._pending.clear()
            if self.on_disconnect is not None:
                self.on_disconnect(f"{self.host}:{self.port}: {reason}")

    def _deliver(self, body: bytes) -> None:
        try:
            msg = reply_of(body)
        except ValueError:
            return
        rid = msg.i
        fut = self._pending.pop(rid, None) if rid is not None else None
        if fut is not None and not fut.done():
            fut.set_result(msg)

    async def call(self, method: str, params: Any = None, timeout_s: float | None = None,
                   reply_type: Any = None) -> Any:
        """Call ``method`` with ``params`` (plain data, a ``Message`` or a dataclass) and
        return the result (decoded as ``reply_type`` when given)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        writer = await self._ensure_connected()
        rid = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            writer.write(pack_frame({"i": rid, "m": method, "p": params}))
            if writer.transport.get_write_buffer_size() > 4 * 2**20:
                await writer.drain()
            msg = await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise RpcTimeout(f"{method} to {self.host}:{self.port}: no response in "
                             f"{timeout:.3g} s") from None
        finally:
            self._pending.pop(rid, None)
        return result_of(msg, reply_type)

    async def notify(self, method: str, params: Any = None) -> None:
        """Send a one-way notice (no response, no delivery guarantee)."""
        writer = await self._ensure_connected()
        writer.write(pack_frame({"m": method, "p": params}))

    def notify_now(self, method: str, params: Any = None) -> bool:
        """``notify`` without a coroutine, on the event loop: the notice is written to the
        open connection's transport at once and True returned (written, not delivered:
        no delivery guarantee, as for ``notify``); False (nothing sent) when there is no
        open connection, for ``notify`` to connect. A hot sender (a worker's token frames,
        one notice per engine step) saves a task and a loop turn per notice this way.
        Raises ``ValueError`` as ``notify`` does for a frame over ``MAX_FRAME_BYTES``."""
        writer = self._writer
        if writer is None or writer.is_closing():
            return False
        writer.write(pack_frame({"m": method, "p": params}))
        return True

    async def close(self) -> None:
        """Close the connection; calls in flight fail with ``RpcConnectionError``."""
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader_task
            self._reader_task = None
