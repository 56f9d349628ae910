"""Tokens pushed by the decode (and colocated) workers, routed to the request streams that
wait for them.

A worker sends its token frames one-way (``TokenFrames``, the ``tokens`` notice) on its one
connection to the Conductor, so the frames of a request arrive in the order they were
sent. ``TokenRouter.deliver`` puts each frame on its request's queue after checking the
sequence number: a gap means frames were lost, and the request fails (``TOKEN_GAP``)
rather than stream a hole. A frame nobody waits for (the client went away) is dropped and
its request id returned, for the service to abort it on the worker. ``fail_instance``
fails every stream of a worker that died or left the cluster.

The queues are unbounded on purpose: the worker must never wait for a slow HTTP client,
and a request's queue holds at most one frame per generated token (``max_tokens``, a few
bytes each), so its size is bounded by the request itself. No I/O here: the service feeds
it and consumes it (DESIGN.md §2, pure cores under I/O shells).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pymooncake.rpc import RpcConnectionError, RpcError
from pymooncake.rpc.messages import TokenFrame, TokenFrames


@dataclass(slots=True)
class TokenStream:
    """One request's frames, in order, from one worker."""

    request_id: str
    instance_id: str
    queue: asyncio.Queue[TokenFrame | RpcError] = field(default_factory=asyncio.Queue)
    next_seq: int = 0
    ended: bool = False
    """Its last item is queued (a frame that finishes or fails the request, or a failure);
    later frames are dropped."""

    def fail(self, err: RpcError) -> None:
        if not self.ended:
            self.ended = True
            self.queue.put_nowait(err)

    async def frames(self) -> AsyncIterator[TokenFrame]:
        """The frames until the one that finishes the request; raises ``RpcError`` when the
        request failed on the worker (``DECODE_FAILED``), frames were lost (``TOKEN_GAP``)
        or the worker was lost (``CONNECTION``)."""
        while True:
            item = await self.queue.get()
            if isinstance(item, RpcError):
                raise item
            if item.error is not None:
                raise RpcError("DECODE_FAILED", item.error)
            yield item
            if item.finish_reason is not None:
                return


class TokenRouter:
    """The open ``TokenStream`` of every request being decoded (module docstring)."""

    def __init__(self) -> None:
        self._streams: dict[str, TokenStream] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def open(self, request_id: str, instance_id: str) -> TokenStream:
        """Expect ``request_id``'s frames from ``instance_id`` (before it may send any)."""
        if request_id in self._streams:
            raise ValueError(f"request {request_id} already has a token stream")
        s = self._streams[request_id] = TokenStream(request_id, instance_id)
        return s

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def deliver(self, msg: TokenFrames) -> list[str]:
        """Queue ``msg``'s frames; returns the ids of requests the sender is still decoding
        that nobody here waits for (to be aborted on the sender)."""
        orphans: list[str] = []
        for f in msg.frames:
            s = self._streams.get(f.request_id)
            if s is None or s.instance_id != msg.instance_id:
                if f.finish_reason is None and f.error is None:
                    orphans.append(f.request_id)
                continue
            if s.ended:
                continue
            if f.seq != s.next_seq:
                s.fail(RpcError("TOKEN_GAP", (
                    f"token frame {f.seq} of request {f.request_id} from {msg.instance_id} "
                    f"arrived where frame {s.next_seq} was due: frames were lost")))
                continue
            s.next_seq += 1
            s.ended = f.finish_reason is not None or f.error is not None
            s.queue.put_nowait(f)
        return orphans

    def fail_instance(self, instance_id: str, reason: str) -> int:
        """Fail every open stream from ``instance_id`` (it died or left); returns how many."""
        n = 0
        for s in self._streams.values():
            if s.instance_id == instance_id and not s.ended:
                s.fail(RpcConnectionError(f"worker {instance_id} lost: {reason}"))
                n += 1
        return n
