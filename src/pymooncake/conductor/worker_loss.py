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
        it; a coroutine is cancelled here). Unwatched requests simply await ``call``.

        No task or waiter of its own (three to four guarded calls per P/D request): the
        loss cancels the awaiting task, and the cancellation it caused is turned into
        the loss's error; one from elsewhere still propagates. An answer the call has by
        then (one that arrived in the loss's loop turn) is returned, as before: a prefill
        worker that answers and then closes its connection does not fail the request.
        The error waits for a coroutine ``call`` to finish handling its cancel
        (``RpcClient.call`` does at once)."""
        entry = self._watched.get(request_id)
        if entry is None:
            return await call
        lost = entry[1]
        fut = call if asyncio.isfuture(call) else None     # a future is the caller's
        if lost.done() and not lost.cancelled():    # lost before the call: never started
            if fut is not None and fut.done():
                return fut.result()
            if asyncio.iscoroutine(call):
                call.close()
            raise _loss_error(lost)
        me = asyncio.current_task()
        assert me is not None               # a coroutine run by asyncio runs in a task
        hit = False
        active = True

        def on_lost(f: asyncio.Future[None]) -> None:
            nonlocal hit
            if active and not f.cancelled():
                hit = True
                me.cancel()

        lost.add_done_callback(on_lost)
        try:
            result = await (call if fut is None else asyncio.shield(fut))
        except BaseException as e:
            if not hit:
                raise
            if me.uncancel() > 0 and isinstance(e, asyncio.CancelledError):
                raise                       # cancelled from elsewhere too
            if fut is not None and fut.done() and not fut.cancelled():
                return fut.result()        # its answer came first, by more hops than ours
            raise _loss_error(lost) from None
        finally:
            active = False
            lost.remove_done_callback(on_lost)
        if hit:     # the call returned despite the cancel (3.11's wait_for does when its
            me.uncancel()   # answer was in): an answer is used, never thrown away
        return result


def _loss_error(lost: asyncio.Future[None]) -> BaseException:
    exc = lost.exception()
    assert exc is not None
    return exc
