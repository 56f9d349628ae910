"""A prefill worker's Store puts, off its engine thread (not on the TTFT path).

The engine thread copies a finished prompt's new full blocks out of the paged cache into
the loader's registered staging slots and queues them here (``put``); one thread writes
them to the Store (``StoreKVLoader.put_blocks``). A put waits while the engine has prompts
to compute (its RPCs and copies would take CPU and the GIL from them), but never longer
than ``PUT_DEFER_MAX_S``; what queued up meanwhile goes in the same batch (one put round
trip to the master for a whole burst of prefills, plus an exist for the keys the Store
already had: ``StoreKVLoader.put_blocks``). The wait sleeps until the
engine thread says it has nothing left to compute (``idle``) — it does not poll (a 5 ms
poll woke the thread 200 times a second while the engine computed, issue 16).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from pymooncake.obs.logging import init_logger

logger = init_logger(__name__)

PUT_DEFER_MAX_S = 1.0
"""Longest a Store put waits for the prefill engine to go idle (s)."""
PUT_BATCH_MAX_BLOCKS = 1024
"""Most blocks merged into one Store batch put."""


class StorePuts:
    """The put thread of ``loader`` (a ``StoreKVLoader``): ``busy()`` says the engine has
    prompts to compute, ``stopping()`` that the worker shuts down, ``on_put(keys)`` gets
    the keys the Store holds now (the worker reports them as KV events)."""

    def __init__(self, loader: Any, busy: Callable[[], bool], stopping: Callable[[], bool],
                 on_put: Callable[[list[str]], None], name: str,
                 defer_max_s: float = PUT_DEFER_MAX_S) -> None:
        self.loader = loader
        self._busy = busy
        self._stopping = stopping
        self._on_put = on_put
        self.defer_max_s = defer_max_s
        self._idle = threading.Event()
        """Set by ``idle`` (the engine has nothing to compute) and ``close``."""
        self._closing = False
        self._q: queue.Queue[tuple[float, list[str], list[Any]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._main, daemon=True, name=name)
        self._thread.start()

    def put(self, keys: list[str], data: list[Any]) -> None:
        """Queue blocks staged with ``loader.stage_for_put`` under ``keys``."""
        self._q.put((time.monotonic(), keys, data))

    def idle(self) -> None:
        """The engine thread has no prompt left to compute: a deferred put goes now."""
        self._idle.set()

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued, then stop the thread (waits at most ``timeout_s``)."""
        self._closing = True
        self._q.put(None)
        self._idle.set()
        self._thread.join(timeout_s)

    def _defer(self, queued_s: float) -> None:
        """Wait while the engine computes, until ``defer_max_s`` after ``queued_s``:
        asleep until ``idle`` (the flag is cleared before ``busy()`` is asked, so an
        ``idle`` after the question is never missed)."""
        while not self._stopping():
            left = queued_s + self.defer_max_s - time.monotonic()
            if left <= 0:
                return
            self._idle.clear()
            if self._closing or not self._busy():
                return
            self._idle.wait(left)

    def _main(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            queued_s, keys, data = item
            self._defer(queued_s)
            keys, data = list(keys), list(data)
            seen = set(keys)
            last = False
            while len(keys) < PUT_BATCH_MAX_BLOCKS:
                try:
                    more = self._q.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    last = True
                    break
                for k, d in zip(more[1], more[2], strict=True):
                    if k not in seen:
                        seen.add(k)
                        keys.append(k)
                        data.append(d)
                    else:                   # a duplicate: its staging slot goes back
                        self.loader.discard_staged([d])
            try:
                self._on_put(self.loader.put_blocks(keys, data))
            except Exception as err:  # noqa: BLE001 - a full Store only costs reuse
                logger.warning("store put failed: %s", err)
            if last:
                return


def stale_store_blocks(hint_blocks: int, cached_tokens: int, num_prompt_tokens: int,
                       block_size: int) -> tuple[int, int]:
    """Block range ``[lo, hi)`` the Conductor's index says the Store holds but this prefill
    did not get from any cache: evicted since (lazy invalidation of the index). Blocks past
    ``(num_prompt_tokens - 1) // block_size`` are never loaded (CASES BUG-09: at least one
    token is computed), so they prove nothing."""
    lo = cached_tokens // block_size
    hi = min(hint_blocks, (num_prompt_tokens - 1) // block_size)
    return (lo, hi) if hi > lo else (lo, lo)
