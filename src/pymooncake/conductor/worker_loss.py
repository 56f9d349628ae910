"""Requests failed at once when a worker they involve is lost (issue 17 Build items 5, 6).

A P/D request waits on its prefill worker while that worker writes the prompt's KV into
the decode worker's receive buffer. When the decode worker is lost — its load reports
stopped (partitioned, frozen, dead) or its connection to the Conductor closed — nothing
on the prefill side fails the request soon: a write to a host whose frames are dropped
silently only fails after the Transfer Engine's retries. ``WorkerLossWatch`` lets the
service await a worker call *or* the loss of any worker the request involves, whichever
comes first; on a loss the request fails with ``WORKER_LOST`` (an ``RpcError``, so the
service answers 503 ``worker_failed``) and the service's cleanup aborts it on the
workers still there, which releases its KV pins, receive buffer and write batches at once.

No I/O here: the service feeds it (``lost``) and awaits through it (``guard``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Iterable
from typing import TypeVar

from pymooncake.rpc import RpcError

T = TypeVar("T")


class WorkerLossWatch:
    """Per request: the workers it involves and a future failed when one of them is lost."""

    def __init__(self) -> None:
        self._watched: dict[str, tuple[frozenset[str], asyncio.Future[None]]] = {}

    def __len__(self) -> int:
        return len(self._watched)

    def watch(self, request_id: str, instance_ids: Iterable[str | None]) -> None:
        """Fail ``request_id``'s guarded calls if any of ``instance_ids`` is lost."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._watched[request_id] = (frozenset(i for i in instance_ids if i), fut)

    def forget(self, request_id: str) -> None:
        entry = self._watched.pop(request_id, None)
        if entry is None:
            return
        fut = entry[1]
        if not fut.done():
            fut.cancel()
        elif not fut.cancelled():
            fut.exception()        # a loss nobody awaited: retrieved, not logged at exit

    def lost(self, instance_id: str, reason: str) -> list[str]:
        """``instance_id`` left the cluster (``reason``): fail the watched requests that
        involve it; returns their ids."""
        hit = []
        for rid, (ids, fut) in self._watched.items():
            if instance_id in ids and not fut.done():
                fut.set_exception(RpcError("WORKER_LOST",
                                           f"worker {instance_id} lost: {reason}"))
                hit.append(rid)
        return hit

    async def guard(self, request_id: str, call: Awaitable[T]) -> T:
        """``await call``, unless a worker ``request_id`` involves is lost first: then
        ``RpcError("WORKER_LOST")`` (a future ``call`` is left to the caller, which cancels
        it; a coroutine is cancelled here). Unwatched requests simply await ``call``."""
        entry = self._watched.get(request_id)
        if entry is None:
            return await call
        lost = entry[1]
        owned = not asyncio.isfuture(call)
        task = asyncio.ensure_future(call)
        waiter = asyncio.ensure_future(_wait_done(lost))
        try:
            await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            with contextlib.suppress(BaseException):
                await waiter
        if task.done() or not lost.done() or lost.cancelled():
            return await task
        if owned:
            task.cancel()
            task.add_done_callback(_consume)   # its own late error is not news
        exc = lost.exception()
        assert exc is not None
        raise exc


def _consume(task: asyncio.Future[object]) -> None:
    """Retrieve a given-up call's outcome, so asyncio does not log "Task exception was
    never retrieved" when the call ends with an error after its cancel."""
    if not task.cancelled():
        task.exception()


async def _wait_done(fut: asyncio.Future[None]) -> None:
    """Wait until ``fut`` is done without consuming or cancelling it."""
    with contextlib.suppress(BaseException):
        await asyncio.shield(fut)
