"""A non-streamed request whose client hangs up stops at once (CASES BUG-73 step 5,
issue 17 Build item 6).

A streamed response notices a closed connection when it writes the next chunk; a
non-streamed one writes nothing until the whole completion is generated, so without a
watch it would decode to ``max_tokens`` for nobody. ``collect_or_disconnect`` reads the
request's ASGI ``receive`` channel (after the body: the next message is
``http.disconnect``) alongside the generation and cancels the generation when the client
leaves first: the cancellation runs the backend's cleanup, which aborts the request on
its workers (KV pins and receive buffers released there).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

CLIENT_CLOSED = 499
"""Status recorded for a request whose client left before its answer (nginx's code)."""


async def until_disconnected(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    """Return once ``receive`` (ASGI, the body already read) says the client left."""
    while True:
        msg = await receive()
        if msg.get("type") == "http.disconnect":
            return


async def collect_or_disconnect(parts: AsyncIterator[Any],
                                receive: Callable[[], Awaitable[dict[str, Any]]]
                                ) -> list[Any] | None:
    """Every item of ``parts``; ``None`` when the client disconnected first (then
    ``parts`` was cancelled mid-iteration and closed). Exceptions of ``parts`` propagate."""
    async def collect() -> list[Any]:
        return [p async for p in parts]

    work = asyncio.ensure_future(collect())
    watch = asyncio.ensure_future(until_disconnected(receive))
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        with contextlib.suppress(BaseException):
            await watch
    if work.done():
        return work.result()
    work.cancel()                      # the generation's own cleanup aborts the request
    with contextlib.suppress(BaseException):
        await work
    aclose = getattr(parts, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(BaseException):
            await aclose()
    return None
