"""``MooncakeDistributedStoreAsync``: every method ``m`` of ``MooncakeDistributedStore``
also as a coroutine ``async_m`` (the same arguments and results), run on the event loop's
default executor so the loop is never blocked by a store call."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any

from pymooncake.store.compat._store import MooncakeDistributedStore


class MooncakeDistributedStoreAsync(MooncakeDistributedStore):
    """``await store.async_put(key, value)`` and so on for every public method."""

    def __getattr__(self, name: str) -> Callable[..., Coroutine[Any, Any, Any]]:
        if not name.startswith("async_") or name.startswith("async__"):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}")
        sync = getattr(self, name[len("async_"):], None)
        if not callable(sync):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r} "
                                 f"(nor a method {name[len('async_'):]!r})")

        @functools.wraps(sync)
        async def call(*args: Any, **kwargs: Any) -> Any:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, functools.partial(sync, *args, **kwargs))

        self.__dict__[name] = call
        return call
