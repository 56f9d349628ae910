"""``LoopPoster``: callbacks from the engine thread run on the worker's event loop; and
the futures they settle, settled only while still pending."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any

from pymooncake.obs.logging import init_logger

logger = init_logger(__name__)


class LoopPoster:
    """Runs callbacks on ``loop`` from another thread, in the order they were posted.
    Posts made before the loop gets to them share one wake-up (one write to its
    self-pipe): an engine step's token push and the futures it settles cost one."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._posted: collections.deque[Callable[[], None]] = collections.deque()
        self._scheduled = False

    def post(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop (any thread; the engine thread in a worker)."""
        self._posted.append(fn)
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon_threadsafe(self._run)

    def _run(self) -> None:  # event loop
        self._scheduled = False   # before draining: a post from now on schedules again
        while self._posted:
            fn = self._posted.popleft()
            try:
                fn()
            except Exception:  # noqa: BLE001 - as the loop would: log it, run the rest
                logger.exception("posted callback %r failed", fn)


def set_result_if_pending(fut: asyncio.Future[Any], r: Any) -> None:
    """Resolve ``fut`` unless it is done already (cancelled by its caller, say)."""
    if not fut.done():
        fut.set_result(r)


def set_exception_if_pending(fut: asyncio.Future[Any], e: BaseException) -> None:
    """Fail ``fut`` unless it is done already."""
    if not fut.done():
        fut.set_exception(e)
