"""Front-door admission: a concurrency limit, a bounded priority queue, a queue timeout.

Overload is signalled the way clients and proxies back off from (CASES BUG-52): a full
queue is HTTP 429, a queue timeout is HTTP 503, both with ``Retry-After`` (integer
seconds ≥ 1) and the codes ``queue_full`` / ``queue_timeout``. Requests with
``priority > 0`` are sheddable: once saturation reaches 1.0 they are refused at once
(429 ``saturated``, as the Conductor's own saturation refusal) instead of queued, while
``priority <= 0`` requests wait (CASES BUG-51). Saturation is computed from the live
counters at each call, never from a snapshot.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from dataclasses import dataclass

from pymooncake.rpc.messages import Rejection, RequestRejected


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    max_concurrency: int = 64
    """Requests admitted to the Conductor at once."""
    queue_capacity: int = 256
    """Requests waiting for a slot at most; one more is refused with 429."""
    queue_timeout_s: float = 30.0
    """Longest wait for a slot (s); then 503."""
    retry_after_s: float = 1.0
    """``Retry-After`` sent with rejections (rounded up to whole seconds, ≥ 1)."""

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.queue_capacity < 0:
            raise ValueError(f"queue_capacity must be >= 0, got {self.queue_capacity}")
        if self.queue_timeout_s <= 0:
            raise ValueError(f"queue_timeout_s must be > 0, got {self.queue_timeout_s}")

    @property
    def retry_after_header(self) -> int:
        return max(1, math.ceil(self.retry_after_s))


class AdmissionGate:
    """Slots for ``max_concurrency`` requests; waiters served by (priority, arrival)."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self.in_flight = 0
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    @property
    def num_queued(self) -> int:
        return sum(1 for _, _, f in self._waiters if not f.done())

    @property
    def saturation(self) -> float:
        """In-flight requests over the concurrency limit (≥ 1.0 = saturated), live."""
        return self.in_flight / self.config.max_concurrency

    def _reject(self, status: int, code: str, message: str) -> RequestRejected:
        return RequestRejected(Rejection(status, code, message, self.config.retry_after_s))

    async def acquire(self, priority: int = 0) -> None:
        """Take a slot, waiting in the queue if needed.

        Raises ``RequestRejected``: 429 ``saturated`` when the request is sheddable
        (``priority > 0``) and the gate is saturated (CASES BUG-51), 429 ``queue_full``
        when the queue is full, 503 ``queue_timeout`` when no slot frees up within
        ``queue_timeout_s`` (BUG-52).
        """
        cfg = self.config
        if self.in_flight < cfg.max_concurrency and not self._waiters:
            self.in_flight += 1
            return
        if priority > 0 and self.saturation >= 1.0:
            raise self._reject(429, "saturated",
                               f"server saturated ({self.in_flight} requests in flight); "
                               f"sheddable request (priority {priority}) refused")
        if self.num_queued >= cfg.queue_capacity:
            raise self._reject(429, "queue_full",
                               f"admission queue full ({cfg.queue_capacity} waiting)")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (priority, next(self._seq), fut))
        try:
            await asyncio.wait_for(asyncio.shield(fut), cfg.queue_timeout_s)
        except TimeoutError:
            if fut.done() and not fut.cancelled():
                return  # the slot arrived at the deadline: keep it
            fut.cancel()
            raise self._reject(503, "queue_timeout",
                               f"no slot within {cfg.queue_timeout_s:g} s") from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # we were handed a slot but the client went away
            else:
                fut.cancel()
            raise

    def release(self) -> None:
        """Give a slot back; hands it straight to the best waiter if any."""
        while self._waiters:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():
                fut.set_result(None)  # the slot passes on: in_flight unchanged
                return
        self.in_flight -= 1
        assert self.in_flight >= 0, "admission slot released twice"
