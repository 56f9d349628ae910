"""The RPC server's side of one client connection (``RpcServer``): frames parsed as they
arrive and handed to the server one by one, the answers of one read batched into one
write, reading paused while the peer does not read, and the server's work after the
answers (``RpcServer.after_reply``) run before the next frame and at the read's end."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from pymooncake.obs.logging import init_logger
from pymooncake.rpc.codec import HEADER, MAX_FRAME_BYTES, pack_frame
from pymooncake.rpc.errors import ErrorCode, RpcError

if TYPE_CHECKING:
    from pymooncake.rpc.server import RpcServer

logger = init_logger(__name__)


class Connection(asyncio.Protocol):
    """One client connection: frames parsed as they arrive, plain handlers run inline, and
    the responses of one read (or, for coroutine handlers, of one event-loop turn) go out
    in one write. Reading pauses while more than the transport's high-water mark of
    responses is unsent (the peer does not read)."""

    def __init__(self, server: RpcServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peer: Any = None
        self.buf = bytearray()
        self.frames: list[bytes] = []
        self.scheduled = False
        self.reading = False   # inside data_received: the read's end writes the responses
        self.dead = False
        self.pending: set[asyncio.Task[None]] = set()
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        self.peer = transport.get_extra_info("peername")
        transport.set_write_buffer_limits(high=4 * 2**20)

    def data_received(self, data: bytes) -> None:
        if self.dead:
            return
        buf = self.buf
        if buf:
            buf += data
            view: bytes | bytearray = buf
        else:
            view = data
        n = len(view)
        pos = 0
        hsize = HEADER.size
        self.reading = True
        server = self.server
        try:
            while n - pos >= hsize:
                (length,) = HEADER.unpack_from(view, pos)
                if length > MAX_FRAME_BYTES:
                    logger.warning("rpc: frame of %d bytes from %s refused; closing",
                                   length, self.peer)
                    self.send(None, error=RpcError(
                        ErrorCode.MALFORMED_FRAME,
                        f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}"))
                    self.close()
                    return
                end = pos + hsize + length
                if n < end:
                    break
                if server._deferred:  # an earlier frame's work, before this one is served
                    server._run_deferred()
                server._dispatch(view[pos + hsize:end], self)
                pos = end
        finally:
            self.reading = False
            try:
                self.flush()
            finally:
                if server._deferred:
                    server._run_deferred()
        if pos and self.server.poll_s:
            self.server._frames_seen()
        if view is data:
            if pos < n:
                buf += data[pos:]
        elif pos:
            del buf[:pos]

    def spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    def send(self, rid: int | None, result: Any = None, error: RpcError | None = None) -> None:
        if rid is None and error is None:
            return  # one-way notice
        if self.transport is None or self.transport.is_closing():
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
        if not self.reading and not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self.scheduled = False
        if not self.frames:
            return
        frames, self.frames = self.frames, []
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(frames) if len(frames) > 1 else frames[0])

    def pause_writing(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def close(self) -> None:
        """Send what is queued, then close; handlers still running are cancelled."""
        self.dead = True
        self.flush()
        for t in self.pending:
            t.cancel()
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.dead = True
        for t in self.pending:
            t.cancel()
        self.server._conns.discard(self)
        if not self.closed.done():
            self.closed.set_result(None)
