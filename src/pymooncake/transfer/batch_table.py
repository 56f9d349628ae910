"""The batch table: per-batch request statuses, completion and waiting (DESIGN.md §4).

A batch (``allocate_batch(n)``) holds up to ``n`` requests. Transports report outcomes
here (:meth:`BatchTable.finish_request` for whole requests, :meth:`finish_slices` for tcp
slices, a window at a time); callers read statuses and wait on a condition (threads) or a
future (coroutines). One lock guards the table; waiters are woken only when someone
listens.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pymooncake.transfer import metrics as m
from pymooncake.transfer.batch import (
    BatchId,
    StatusCode,
    TransferError,
    TransferState,
    TransferStatus,
)
from pymooncake.transfer.transports.base import Slice
from pymooncake.transfer.transports.local import CopyJob

_LATENCY = {t: m.latency_seconds.labels(t) for t in ("none", "local", "shm", "cma", "tcp")}
_BYTES_NO_PATH = {t: m.bytes_total.labels(t, "-") for t in ("local", "shm", "cma")}


@dataclass(slots=True, eq=False)
class RequestState:
    """One submitted request: its status, transport, tcp slices left, size, start time."""

    status: TransferStatus
    transport: str = ""
    remaining: int = 0
    nbytes: int = 0
    t0: float = 0.0
    failure: TransferStatus | None = None
    """The first failed slice's status (tcp): the request fails with it once every one of
    its slices has ended, never while one may still move bytes of it."""


@dataclass(slots=True, eq=False)
class BatchState:
    batch_id: BatchId
    capacity: int
    reqs: list[RequestState] = field(default_factory=list)
    num_pending: int = 0
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = field(
        default_factory=list)


class BatchTable:
    """Every live batch of one engine. Thread-safe; :meth:`wait_async` for coroutines."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._done = threading.Condition(self.lock)
        self._num_waiting = 0  # threads in wait(): notify only when someone listens
        self._batches: dict[int, BatchState] = {}
        self._ids = itertools.count(1)
        self.closed = False

    # ------------------------------------------------------------------ lifecycle
    def allocate(self, n: int) -> BatchId:
        if n < 0:
            raise ValueError(f"batch size must be >= 0, got {n}")
        with self.lock:
            bid = BatchId(next(self._ids))
            self._batches[bid] = BatchState(bid, n)
        return bid

    def free(self, batch_id: BatchId) -> None:
        with self.lock:
            batch = self.get_locked(batch_id)
            if batch.num_pending:
                raise TransferError(f"batch {batch_id} still has {batch.num_pending} pending "
                                    "requests; wait for it before freeing")
            del self._batches[batch_id]

    def pop_if_done(self, batch_id: BatchId) -> list[TransferStatus] | None:
        """Free the batch and return its statuses if nothing is pending, else ``None``."""
        with self.lock:
            batch = self._batches.get(batch_id)
            if batch is None or batch.num_pending:
                return None
            del self._batches[batch_id]
            return [r.status for r in batch.reqs]

    def fail_all(self, reason: str) -> None:
        """Fail every pending request ``INTERNAL`` with ``reason`` and wake every waiter."""
        with self.lock:
            self.closed = True
            for b in self._batches.values():
                for r in b.reqs:
                    if r.status.state is TransferState.PENDING:
                        r.status = TransferStatus.failed(StatusCode.INTERNAL, reason)
                b.num_pending = 0
                _wake_async(b)
            self._done.notify_all()

    def get_locked(self, batch_id: BatchId) -> BatchState:
        """The batch (the lock is held); ``TransferError`` when unknown."""
        batch = self._batches.get(batch_id)
        if batch is None:
            raise TransferError(f"unknown batch id {batch_id} (never allocated or freed)")
        return batch

    def wake_locked(self, batch: BatchState) -> None:
        """Wake whoever waits for ``batch`` (the lock is held)."""
        if self._num_waiting:
            self._done.notify_all()
        if batch.waiters:
            _wake_async(batch)

    # ------------------------------------------------------------------ outcomes
    def finish_locked(self, batch: BatchState, idx: int, status: TransferStatus,
                      transport: str, tally: dict[float, int] | None = None) -> None:
        """Make request ``idx`` final (the lock is held). With ``tally`` its latency is
        counted there (``{t0: n}``, observed later by :func:`_observe`) instead of at once."""
        r = batch.reqs[idx]
        if r.status.state is not TransferState.PENDING:
            return
        r.status = status
        batch.num_pending -= 1
        if status.state is TransferState.FAILED:
            m.failures_total.labels(transport, status.code.value).inc()
        elif tally is not None:
            tally[r.t0] = tally.get(r.t0, 0) + 1
        else:
            _LATENCY[transport].observe(time.monotonic() - r.t0)
        if batch.num_pending == 0:
            self.wake_locked(batch)

    def finish_request(self, batch_id: BatchId, idx: int, status: TransferStatus,
                       transport: str) -> None:
        with self.lock:
            batch = self._batches.get(batch_id)
            if batch is not None:
                self.finish_locked(batch, idx, status, transport)

    def finish_slices(self, outcomes: Sequence[tuple[Slice, StatusCode, str]]) -> None:
        """Record tcp slice outcomes (one lock for a whole window)."""
        tally: dict[float, int] = {}
        ok = StatusCode.OK
        pending = TransferState.PENDING
        with self.lock:
            batches = self._batches
            for s, code, msg in outcomes:
                batch = batches.get(s.batch_id)
                if batch is None:
                    continue
                r = batch.reqs[s.request_index]
                if r.status.state is not pending:
                    continue
                if code is not ok and r.failure is None:
                    r.failure = TransferStatus.failed(code, msg)
                r.remaining -= 1
                if not r.remaining:  # final only once no slice of it can write any more
                    self.finish_locked(batch, s.request_index,
                                       r.failure or completed(r.nbytes), "tcp", tally)
        _observe("tcp", tally)

    def finish_copies(self, jobs: Sequence[CopyJob], error: str,
                      code: StatusCode = StatusCode.INTERNAL) -> None:
        """Finish local/shm/cma requests (from the copy thread, or inline): OK, or failed
        ``code`` with ``error``."""
        tallies: dict[str, dict[float, int]] = {"local": {}, "shm": {}, "cma": {}}
        with self.lock:
            for j in jobs:
                batch = self._batches.get(j.batch_id)
                if batch is None:
                    continue
                if error:
                    status = TransferStatus.failed(code, error)
                else:
                    _BYTES_NO_PATH[j.transport].inc(j.length)
                    status = completed(j.length)
                self.finish_locked(batch, j.index, status, j.transport,
                                   tallies[j.transport])
        for transport, tally in tallies.items():
            _observe(transport, tally)

    # ------------------------------------------------------------------ reading
    def status(self, batch_id: BatchId, i: int) -> TransferStatus:
        with self.lock:
            reqs = self.get_locked(batch_id).reqs
            if not 0 <= i < len(reqs):
                held = (f"indices 0..{len(reqs) - 1}" if reqs else "none submitted yet")
                raise IndexError(f"batch {batch_id} has no request {i}: it holds "
                                 f"{len(reqs)} submitted requests ({held})")
            return reqs[i].status

    def statuses(self, batch_id: BatchId) -> list[TransferStatus]:
        with self.lock:
            return [r.status for r in self.get_locked(batch_id).reqs]

    def wait(self, batch_id: BatchId, timeout_s: float | None = None) -> list[TransferStatus]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self.lock:
            batch = self.get_locked(batch_id)
            while batch.num_pending and not self.closed:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._num_waiting += 1
                try:
                    self._done.wait(timeout=remaining)
                finally:
                    self._num_waiting -= 1
            return [r.status for r in batch.reqs]

    async def wait_async(self, batch_id: BatchId,
                         timeout_s: float | None = None) -> list[TransferStatus]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self.lock:
            batch = self.get_locked(batch_id)
            if batch.num_pending == 0:
                return [r.status for r in batch.reqs]
            batch.waiters.append((loop, fut))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(fut, timeout=timeout_s)
        return self.statuses(batch_id)


_COMPLETED: dict[int, TransferStatus] = {}


def completed(nbytes: int) -> TransferStatus:
    """``TransferStatus.completed(nbytes)``, shared (statuses are immutable)."""
    st = _COMPLETED.get(nbytes)
    if st is None:
        if len(_COMPLETED) >= 4096:
            _COMPLETED.clear()
        st = _COMPLETED[nbytes] = TransferStatus.completed(nbytes)
    return st


def _observe(transport: str, tally: dict[float, int]) -> None:
    """Observe the latencies counted in ``tally`` (``{t0: requests}``) as of now."""
    if tally:
        now = time.monotonic()
        for t0, n in tally.items():
            m.observe_many(_LATENCY[transport], now - t0, n)


def observe_noop() -> None:
    _LATENCY["none"].observe(0.0)


def observe_latency(transport: str, seconds: float) -> None:
    """One request of ``transport`` completed in ``seconds`` (without the table)."""
    _LATENCY[transport].observe(seconds)


def _wake_async(batch: BatchState) -> None:
    for loop, fut in batch.waiters:
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_set_done, fut)
    batch.waiters.clear()


def _set_done(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
