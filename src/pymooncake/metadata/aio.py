"""Bounded waits that never swallow a cancellation (for long-running metadata loops).

On Python 3.11 two common idioms lose a ``Task.cancel()`` aimed at the *caller*:

* ``task.cancel(); with suppress(CancelledError): await task`` — a cancellation of the
  caller that arrives while it waits is forwarded to ``task``, comes back as ``task``'s
  ``CancelledError`` and is suppressed: the caller goes on as if nothing happened;
* ``await asyncio.wait_for(aw, t)`` — when ``aw`` completes in the same loop iteration as
  the cancellation arrives, ``wait_for`` returns ``aw``'s result and drops the
  cancellation (fixed in Python 3.12).

A loop that lost its cancellation never ends, so ``await``-ing it on stop hung forever
(an HA master's ``stop()`` in a loaded CI run). These helpers use ``asyncio.wait``, which
lets the caller's cancellation through, and bound every wait.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from pymooncake.obs.logging import init_logger

logger = init_logger(__name__)

T = TypeVar("T")

STOP_TIMEOUT_S = 5.0
"""Longest ``cancel_and_wait`` waits for a task to end by default."""
RECANCEL_S = 1.0
"""A task still running this long after its cancellation is cancelled again (it may
have swallowed the first one)."""


async def cancel_and_wait(task: asyncio.Future[Any] | None, what: str = "task",
                          timeout_s: float = STOP_TIMEOUT_S) -> bool:
    """Cancel ``task`` and wait until it ends, at most ``timeout_s`` seconds; True when it
    ended (``None`` or an already finished task: True at once). Its result or error is
    retrieved and dropped. A task that keeps running is cancelled again every
    ``RECANCEL_S`` and, past ``timeout_s``, left running with an ERROR log naming
    ``what``. A cancellation of the caller while it waits propagates (is not swallowed)."""
    if task is None:
        return True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not task.done():
        left = deadline - loop.time()
        if left <= 0:
            logger.error("%s did not end within %.1f s of its cancellation; leaving it "
                         "running", what, timeout_s)
            return False
        task.cancel()
        await asyncio.wait({task}, timeout=min(RECANCEL_S, left))
    if not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" warning
    return True


async def next_within(it: AsyncIterator[T], timeout_s: float) -> T | None:
    """The next item of ``it``, or ``None`` when ``timeout_s`` passes first (exceptions of
    ``__anext__``, ``StopAsyncIteration`` included, propagate). Unlike ``wait_for``, a
    cancellation of the caller is never dropped, even when an item arrives with it."""
    fut = asyncio.ensure_future(it.__anext__())
    try:
        await asyncio.wait({fut}, timeout=max(0.0, timeout_s))
    finally:
        if not fut.done():  # timed out, or the caller was cancelled: stop the read, and
            fut.cancel()    # let it end before the next one starts (bounded)
            await asyncio.wait({fut}, timeout=RECANCEL_S)
        if fut.done() and not fut.cancelled():
            fut.exception()  # (retrieved even when the caller's cancellation goes on)
    if fut.done() and not fut.cancelled():
        return fut.result()
    return None


async def wait_set(event: asyncio.Event, timeout_s: float) -> bool:
    """Whether ``event`` is set within ``timeout_s`` (the caller's cancellation
    propagates, unlike ``wait_for(event.wait(), t)`` on Python 3.11)."""
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=max(0.0, timeout_s))
    finally:
        waiter.cancel()
    return event.is_set()
