"""RPC server: asyncio TCP, one reader loop per connection, handlers by method name.

A handler is a plain function or a coroutine function taking the request's params (a
dataclass instance when registered with ``params_type``, else the decoded msgpack value)
and returning msgpack-able data or a dataclass. Plain functions run inline on the event
loop (they must not block: pure cores only); coroutines run as tasks owned by the
connection, so one slow call does not hold up the others.

A malformed frame is answered with ``MALFORMED_FRAME`` where the request id could be read,
and the connection is closed when the stream cannot be resynchronised (bad length).
Other connections are never affected.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Callable
from typing import Any

from pymooncake.obs import metrics
from pymooncake.obs.logging import init_logger
from pymooncake.rpc.codec import HEADER, MAX_FRAME_BYTES, from_wire, pack_frame, unpack_body
from pymooncake.rpc.errors import ErrorCode, RpcError

logger = init_logger(__name__)

RPC_REQUESTS = metrics.counter(
    "pymooncake_rpc_server_requests_total", "RPC requests served, by method and result code",
    ["method", "code"])
RPC_LATENCY = metrics.histogram(
    "pymooncake_rpc_server_latency_seconds", "RPC handler latency (s), by method", ["method"])


class _Method:
    __slots__ = ("fn", "params_type", "is_async", "name", "latency", "ok")

    def __init__(self, name: str, fn: Callable[..., Any], params_type: type | None) -> None:
        self.name = name
        self.fn = fn
        self.params_type = params_type
        self.is_async = inspect.iscoroutinefunction(fn)
        self.latency = RPC_LATENCY.labels(name)  # labelled children cached: hot path
        self.ok = RPC_REQUESTS.labels(name, "OK")


class RpcServer:
    """Serve registered methods on ``host:port`` (``port=0`` picks a free port).

    Usage::

        server = RpcServer("127.0.0.1", 0)
        server.register("ping", lambda params: "pong")
        await server.start()      # server.port is now bound
        ...
        await server.stop()
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self._requested_port = port
        self._methods: dict[str, _Method] = {}
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self.port: int = port

    def register(self, name: str, handler: Callable[..., Any],
                 params_type: type | None = None) -> None:
        """Serve ``name`` with ``handler``; ``params_type`` (a dataclass) validates params."""
        if name in self._methods:
            raise ValueError(f"RPC method {name!r} registered twice")
        self._methods[name] = _Method(name, handler, params_type)

    async def start(self) -> None:
        """Bind and start accepting connections."""
        self._server = await asyncio.start_server(self._on_connect, self.host,
                                                  self._requested_port, limit=2**20)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop accepting, close every connection and wait for their loops to end."""
        if self._server is not None:
            self._server.close()
        for task in list(self._conns):
            task.cancel()
        for task in list(self._conns):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None

    async def serve_forever(self) -> None:
        """``start()`` if needed, then serve until cancelled."""
        if self._server is None:
            await self.start()
        assert self._server is not None
        await self._server.serve_forever()

    # -- connection loop -------------------------------------------------------------

    def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = asyncio.ensure_future(self._serve_conn(reader, writer))
        self._conns.add(conn)
        conn.add_done_callback(self._conns.discard)

    async def _serve_conn(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        """Read frames in bulk; responses produced in one loop turn go out in one write."""
        pending: set[asyncio.Task[None]] = set()
        out = _Outbox(writer)
        peer = writer.get_extra_info("peername")
        buf = bytearray()
        try:
            while True:
                try:
                    data = await reader.read(1 << 18)
                except ConnectionError:
                    return
                if not data:
                    return
                buf += data
                pos = 0
                while len(buf) - pos >= HEADER.size:
                    (length,) = HEADER.unpack_from(buf, pos)
                    if length > MAX_FRAME_BYTES:
                        logger.warning("rpc: frame of %d bytes from %s refused; closing",
                                       length, peer)
                        out.send(None, error=RpcError(
                            ErrorCode.MALFORMED_FRAME,
                            f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}"))
                        out.flush()
                        return
                    end = pos + HEADER.size + length
                    if len(buf) < end:
                        break
                    self._dispatch(bytes(buf[pos + HEADER.size:end]), out, pending)
                    pos = end
                if pos:
                    del buf[:pos]
                if writer.transport.get_write_buffer_size() > 4 * 2**20:
                    await writer.drain()
        finally:
            for t in pending:
                t.cancel()
            out.flush()
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    def _dispatch(self, body: bytes, out: _Outbox,
                  pending: set[asyncio.Task[None]]) -> None:
        try:
            msg = unpack_body(body)
        except ValueError as e:
            out.send(None, error=RpcError(ErrorCode.MALFORMED_FRAME, str(e)))
            return
        if not isinstance(msg, dict) or not isinstance(msg.get("m"), str):
            rid = msg.get("i") if isinstance(msg, dict) else None
            out.send(rid if isinstance(rid, int) else None, error=RpcError(
                ErrorCode.MALFORMED_FRAME, "a request is a map with a str 'm' (method)"))
            return
        rid = msg.get("i")
        if rid is not None and not isinstance(rid, int):
            out.send(None, error=RpcError(ErrorCode.MALFORMED_FRAME,
                                                    "request id 'i' must be an int"))
            return
        name = msg["m"]
        method = self._methods.get(name)
        if method is None:
            _count(name[:64], ErrorCode.UNKNOWN_METHOD)
            out.send(rid, error=RpcError(ErrorCode.UNKNOWN_METHOD,
                                                   f"no RPC method {name!r}"))
            return
        params = msg.get("p")
        if method.params_type is not None:
            try:
                params = from_wire(method.params_type, params if params is not None else {})
            except ValueError as e:
                _count(name, ErrorCode.INVALID_ARGUMENT)
                out.send(rid, error=RpcError(ErrorCode.INVALID_ARGUMENT, str(e)))
                return
        if method.is_async:
            task = asyncio.ensure_future(self._run_async(method, params, rid, out))
            pending.add(task)
            task.add_done_callback(pending.discard)
        else:
            start = time.perf_counter()
            try:
                result = method.fn(params)
            except Exception as e:  # noqa: BLE001 - every failure becomes an error response
                self._finish(method, rid, out, start, error=e)
            else:
                self._finish(method, rid, out, start, result=result)

    async def _run_async(self, method: _Method, params: Any, rid: int | None,
                         out: _Outbox) -> None:
        start = time.perf_counter()
        try:
            result = await method.fn(params)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure becomes an error response
            self._finish(method, rid, out, start, error=e)
        else:
            self._finish(method, rid, out, start, result=result)

    def _finish(self, method: _Method, rid: int | None, out: _Outbox,
                start: float, result: Any = None, error: BaseException | None = None) -> None:
        method.latency.observe(time.perf_counter() - start)
        if error is not None:
            if not isinstance(error, RpcError):
                logger.exception("rpc: handler %s raised", method.name, exc_info=error)
                error = RpcError(ErrorCode.INTERNAL, f"{type(error).__name__}: {error}")
            _count(method.name, error.code)
            out.send(rid, error=error)
        else:
            method.ok.inc()
            out.send(rid, result=result)


_counters: dict[tuple[str, str], Any] = {}


def _count(method: str, code: str) -> None:
    """``RPC_REQUESTS{method, code} += 1`` with the labelled child cached (hot path)."""
    child = _counters.get((method, code))
    if child is None:
        child = _counters[(method, code)] = RPC_REQUESTS.labels(method, code)
    child.inc()


class _Outbox:
    """Frames for one connection, written together once per event-loop turn."""

    __slots__ = ("writer", "frames", "scheduled")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.frames: list[bytes] = []
        self.scheduled = False

    def send(self, rid: int | None, result: Any = None, error: RpcError | None = None) -> None:
        if rid is None and error is None:
            return  # one-way notice
        if self.writer.is_closing():
            return
        try:
            if error is not None:
                frame = pack_frame({"i": rid, "e": error.to_wire()})
            else:
                frame = pack_frame({"i": rid, "r": result})
        except (TypeError, ValueError) as e:
            frame = pack_frame({"i": rid, "e": RpcError(
                ErrorCode.INTERNAL, f"unencodable response: {e}").to_wire()})
        self.frames.append(frame)
        if not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self.scheduled = False
        if not self.frames:
            return
        frames, self.frames = self.frames, []
        if not self.writer.is_closing():
            self.writer.write(b"".join(frames) if len(frames) > 1 else frames[0])
