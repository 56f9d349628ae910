"""RPC server: asyncio TCP (and, for clients on the same host, a Unix socket:
``rpc.local``), one protocol object per connection (``rpc.connection``), handlers by method
name.

A handler is a plain function or a coroutine function taking the request's params (a
``Message`` or dataclass instance when registered with ``params_type``, else the decoded
msgpack value)
and returning msgpack-able data or a dataclass. Plain functions run inline on the event
loop as each frame arrives (they must not block: pure cores only), and the responses to
one read go out in one write; coroutines run as tasks owned by the connection, so one slow
call does not hold up the others. A plain function may return a coroutine (its rare slow
path, e.g. waiting for room): that is awaited as a task, and its result is the answer.
A plain handler may also hand the server work to do after it returns
(``RpcServer.after_reply``: the clean-up of a call whose answer is already known, as
Redis's ``UNLINK`` frees memory after replying; a lone caller's answer is written first);
it runs before the server dispatches any other request, so no caller can tell it was
deferred.

A malformed frame is answered with ``MALFORMED_FRAME`` where the request id could be read,
and the connection is closed when the stream cannot be resynchronised (bad length);
params that do not match the method's type are answered ``INVALID_ARGUMENT`` naming the
field. Other calls and connections are never affected.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import time
import types
from collections.abc import Callable
from typing import Any

import msgspec

from pymooncake.obs import metrics
from pymooncake.obs.logging import init_logger
from pymooncake.rpc import local
from pymooncake.rpc.codec import (
    NIL,
    Message,
    Request,
    decoder,
    field_error,
    from_wire,
    unpack_body,
)
from pymooncake.rpc.connection import Connection
from pymooncake.rpc.errors import ErrorCode, RpcError

logger = init_logger(__name__)

# loop metrics: bumped in place on the event loop (no lock, no method chain per call)
RPC_REQUESTS = metrics.loop_counter(
    "pymooncake_rpc_server_requests_total", "RPC requests served, by method and result code",
    ["method", "code"])
RPC_LATENCY = metrics.loop_histogram(
    "pymooncake_rpc_server_latency_seconds", "RPC handler latency (s), by method", ["method"])


_REQUEST = decoder(Request)


class _Method:
    __slots__ = ("fn", "params_type", "decoder", "is_async", "name", "latency", "ok")

    def __init__(self, name: str, fn: Callable[..., Any], params_type: type | None) -> None:
        self.name = name
        self.fn = fn
        self.params_type = params_type
        self.decoder = (decoder(params_type) if isinstance(params_type, type)
                        and issubclass(params_type, Message) else None)
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

    def __init__(self, host: str = "127.0.0.1", port: int = 0, poll_s: float = 0.0) -> None:
        if not 0 <= poll_s <= 1:
            raise ValueError(f"poll_s must be in [0, 1] seconds, got {poll_s}")
        self.host = host
        self._requested_port = port
        self._methods: dict[str, _Method] = {}
        self._server: asyncio.base_events.Server | None = None
        self._unix: list[asyncio.base_events.Server] = []
        """The same-host listeners (``rpc.local``)."""
        self._conns: set[Connection] = set()
        self.port: int = port
        self.poll_s = poll_s
        """While requests come at most this far apart (s), poll (non-blocking, yielding
        the CPU between looks) this long after each before sleeping in the kernel: busy
        clients' next request finds the server awake (a wake-up costs more than the request
        on a VM's CPUs); after a quiet spell no poll starts, so an idle server never spins.
        0: never poll. The symmetric of ``SyncRpcClient.poll_s``."""
        self._last_frame = float("-inf")
        self._polling = False
        self.polls = 0
        """Loop turns spent polling (tests and diagnostics)."""
        self._in_handler = False
        self._deferred: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

    def register(self, name: str, handler: Callable[..., Any],
                 params_type: type | None = None) -> None:
        """Serve ``name`` with ``handler``; ``params_type`` (a ``Message``, decoded straight
        from the frame, or a dataclass) validates params."""
        if name in self._methods:
            raise ValueError(f"RPC method {name!r} registered twice")
        self._methods[name] = _Method(name, handler, params_type)

    async def start(self) -> None:
        """Bind and start accepting connections: on TCP, and — for a loopback or wildcard
        ``host`` — on the same-host Unix sockets named after the port (``rpc.local``).
        ``OSError`` when the TCP port or a Unix name is taken (nothing stays bound)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._on_connect, self.host,
                                                self._requested_port)
        self.port = self._server.sockets[0].getsockname()[1]
        try:
            for name in local.server_names(self.host, self.port):
                self._unix.append(await loop.create_unix_server(self._on_connect, name))
        except OSError as e:
            self._close_listeners()
            self._server, self._unix = None, []
            raise local.UnixNameTaken(
                e.errno, f"RPC server on port {self.port}: its same-host Unix socket "
                f"{name[1:]!r} is taken ({e.strerror})") from e

    def _close_listeners(self) -> None:
        for srv in (self._server, *self._unix):
            if srv is not None:
                srv.close()

    async def stop(self) -> None:
        """Stop accepting, close every connection and wait for their loops to end."""
        self._close_listeners()
        conns = list(self._conns)
        for conn in conns:
            conn.close()
        if conns:   # all at once: one slow connection does not add a second per peer
            await asyncio.wait([c.closed for c in conns], timeout=1.0)  # never cancels them
        for srv in (self._server, *self._unix):
            if srv is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(srv.wait_closed(), 2.0)
        self._server, self._unix = None, []

    async def serve_forever(self) -> None:
        """``start()`` if needed, then serve until cancelled; the listeners (TCP and Unix)
        are closed when it ends."""
        if self._server is None:
            await self.start()
        assert self._server is not None
        try:
            await self._server.serve_forever()
        finally:
            self._close_listeners()

    # -- work after the answer ---------------------------------------------------------

    def after_reply(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` after the handler calling this has returned, once the answers
        of its read are written — or, when more frames of the same read follow, just
        before the next of them is dispatched (their answers then go out together, after
        ``fn``). For a plain handler whose answer no longer depends on ``fn``: a lone
        caller gets its answer one step sooner, and ``fn`` runs while it reads it. ``fn``
        runs before any other request is dispatched, from this read or any other
        connection, and before the event loop runs anything else, so every later call
        sees its effects. Work queued by a handler that then raises still runs.
        Called from anywhere else (a coroutine handler, a timer, a direct call) ``fn`` runs
        at once.
        An exception from ``fn`` is logged, never sent (the answer is already out)."""
        if self._in_handler:
            self._deferred.append((fn, args))
        else:
            fn(*args)

    def _run_deferred(self) -> None:
        while self._deferred:
            work, self._deferred = self._deferred, []
            for fn, args in work:
                try:
                    fn(*args)
                except Exception:  # noqa: BLE001 - the answer is out; keep serving
                    logger.exception("rpc: work after a reply (%s) raised",
                                     getattr(fn, "__qualname__", fn))

    # -- polling -------------------------------------------------------------------

    def _frames_seen(self) -> None:
        """A read brought frames: poll if the one before came within ``poll_s``."""
        now, last = time.monotonic(), self._last_frame
        self._last_frame = now
        if now - last < self.poll_s and not self._polling:
            self._polling = True
            asyncio.get_running_loop().call_soon(self._poll)

    def _poll(self) -> None:
        """One polling turn: while a callback is ready, the loop's next wait for I/O does
        not block; the CPU goes to any other runnable thread in between (sched_yield)."""
        if time.monotonic() - self._last_frame >= self.poll_s or self._server is None:
            self._polling = False
            return
        self.polls += 1
        os.sched_yield()
        asyncio.get_running_loop().call_soon(self._poll)

    # -- connections ---------------------------------------------------------------

    def _on_connect(self) -> Connection:
        conn = Connection(self)
        self._conns.add(conn)
        return conn

    def _refuse(self, body: bytes | memoryview, out: Connection, err: msgspec.DecodeError) -> None:
        """Answer a frame that is no request map (the slow path: say what is wrong)."""
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
        if rid is not None and (not isinstance(rid, int) or isinstance(rid, bool)):
            out.send(None, error=RpcError(ErrorCode.MALFORMED_FRAME,
                                          "request id 'i' must be an int"))
            return
        out.send(rid, error=RpcError(ErrorCode.MALFORMED_FRAME,
                                     field_error(err, "request")))

    def _dispatch(self, body: bytes | memoryview, out: Connection) -> None:
        try:
            req = _REQUEST.decode(body)
        except msgspec.DecodeError as e:
            self._refuse(body, out, e)
            return
        name, rid, raw = req.m, req.i, req.p
        method = self._methods.get(name)
        if method is None:
            _count(name[:64], ErrorCode.UNKNOWN_METHOD)
            out.send(rid, error=RpcError(ErrorCode.UNKNOWN_METHOD,
                                                   f"no RPC method {name!r}"))
            return
        if method.decoder is not None:  # typed: every field checked as it is decoded
            try:
                params = method.decoder.decode(raw if len(raw) else NIL)
            except msgspec.DecodeError as e:
                self._invalid(method, rid, out, field_error(
                    e, method.params_type.__name__))  # type: ignore[union-attr]
                return
        else:
            try:
                params = unpack_body(raw) if len(raw) else None
            except ValueError as e:
                out.send(rid, error=RpcError(ErrorCode.MALFORMED_FRAME, str(e)))
                return
            if method.params_type is not None:
                try:
                    params = from_wire(method.params_type, params if params is not None else {})
                except ValueError as e:
                    self._invalid(method, rid, out, str(e))
                    return
        if method.is_async:
            out.spawn(self._run_async(method, params, rid, out))
        else:
            start = time.perf_counter()
            self._in_handler = True  # after_reply defers (to the end of the read)
            try:
                result = method.fn(params)
            except Exception as e:  # noqa: BLE001 - every failure becomes an error response
                error: Exception | None = e
            else:
                error = None
            finally:  # whatever the handler raised (CancelledError too)
                self._in_handler = False
            if error is not None:
                self._finish(method, rid, out, start, error=error)
            elif type(result) is types.CoroutineType:  # a plain handler's slow path
                out.spawn(self._run_async(method, result, rid, out, start))
            else:
                self._finish(method, rid, out, start, result=result)

    @staticmethod
    def _invalid(method: _Method, rid: int | None, out: Connection, why: str) -> None:
        _count(method.name, ErrorCode.INVALID_ARGUMENT)
        out.send(rid, error=RpcError(ErrorCode.INVALID_ARGUMENT, why))

    async def _run_async(self, method: _Method, params: Any, rid: int | None,
                         out: Connection, start: float | None = None) -> None:
        """Answer a coroutine handler; with ``start``, ``params`` is the coroutine a plain
        handler returned (it finished its fast path inline and now has to wait)."""
        if start is None:
            start = time.perf_counter()
            call = method.fn(params)
        else:
            call = params
        try:
            result = await call
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure becomes an error response
            self._finish(method, rid, out, start, error=e)
        else:
            self._finish(method, rid, out, start, result=result)

    def _finish(self, method: _Method, rid: int | None, out: Connection,
                start: float, result: Any = None, error: BaseException | None = None) -> None:
        method.latency.observe(time.perf_counter() - start)
        if error is not None:
            if not isinstance(error, RpcError):
                logger.exception("rpc: handler %s raised", method.name, exc_info=error)
                error = RpcError(ErrorCode.INTERNAL, f"{type(error).__name__}: {error}")
            _count(method.name, error.code)
            out.send(rid, error=error)
        else:
            method.ok.value += 1
            out.send(rid, result=result)


_counters: dict[tuple[str, str], Any] = {}


def _count(method: str, code: str) -> None:
    """``RPC_REQUESTS{method, code} += 1`` with the labelled child cached (hot path)."""
    child = _counters.get((method, code))
    if child is None:
        child = _counters[(method, code)] = RPC_REQUESTS.labels(method, code)
    child.value += 1
