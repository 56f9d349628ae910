"""Cancellable, bounded waits for P→D KV write batches (issue 17 Build items 5 and 6).

A prefill worker's engine thread waits for its requests' KV writes (``kv_sender``) before
the scheduler may reuse the blocks. A write to a decode host that is dead or cut off
(partitioned: frames dropped silently) does not fail until every slice has run out of
retries (``TransferConfig.failure_bound_s``, ~22 s by default), and while the engine thread
waits, every other request on the worker waits too. ``KVWrites`` bounds that wait:

- ``cancel(request_id)`` (any thread: the ``abort`` RPC's event loop) gives up the writes
  of an aborted request at once — the Conductor aborts a request when its decode worker
  leaves the cluster view, so the step loop moves on within one poll (``POLL_S``);
- a batch still pending after the caller's deadline (``KV_WRITE_TIMEOUT_S``: two slice
  timeouts, so one path failover still fits) is given up and its requests fail.

A batch given up is never freed while slices of it are in flight: the reaper thread waits
for it to end (each slice ends within ``failure_bound_s``) and frees it then.

``defer`` takes a batch off the engine thread altogether: a watcher thread reports its
outcome (or that it was given up) and, separately, when it is final — the caller keeps
the memory it reads (the request's KV blocks) pinned until then.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pymooncake.obs.logging import init_logger

if TYPE_CHECKING:
    from pymooncake.transfer import TransferEngine

logger = init_logger(__name__)

KV_WRITE_TIMEOUT_S = 10.0
"""Longest a P→D KV write batch may stay pending before its requests fail (s): two of the
Transfer Engine's slice timeouts (5 s), so a slice retried on a second path still fits."""
POLL_S = 0.05
"""How often a wait looks at cancellations while a batch is pending (s)."""
CANCEL_MEMORY_S = 120.0
"""A cancellation of a request this worker never wrote for is forgotten after this (s)."""


class KVWrites:
    """Waits for ``engine``'s KV write batches; cancellations come from any thread."""

    def __init__(self, engine: TransferEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._cancelled: dict[str, float] = {}
        self._abandoned: queue.Queue[int | None] = queue.Queue()
        self._reaper: threading.Thread | None = None
        self.num_abandoned = 0
        """Batches given up (request aborted or deadline passed) so far."""
        self._deferred: list[_Deferred] = []
        self._watcher: threading.Thread | None = None
        self._wake = threading.Event()
        self._closed = False

    # -- cancellation (any thread) ---------------------------------------------------------
    def cancel(self, request_id: str) -> None:
        """Give up ``request_id``'s writes: a wait for a batch holding only cancelled (or
        failed) requests returns within ``POLL_S``."""
        now = time.monotonic()
        with self._lock:
            self._cancelled[request_id] = now
            if len(self._cancelled) > 1024:          # aborts of requests never seen here
                for rid, t in list(self._cancelled.items()):
                    if now - t > CANCEL_MEMORY_S:
                        del self._cancelled[rid]

    def cancelled(self, request_id: str) -> bool:
        return request_id in self._cancelled

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._cancelled.pop(request_id, None)

    # -- waiting (the engine thread) -------------------------------------------------------
    def wait(self, batch_id: Any, timeout_s: float,
             give_up: Callable[[], bool] | None = None) -> tuple[list[Any] | None, str]:
        """Wait for ``batch_id`` (submitted, not inline) and free it: ``(statuses, "")``
        once every request of it is final; ``(None, why)`` when it was given up first —
        ``give_up()`` said so (checked every ``POLL_S``; its requests were aborted), or
        ``timeout_s`` passed. A batch given up goes to the reaper (freed once it ends)."""
        from pymooncake.transfer import TransferState
        eng = self.engine
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            statuses = eng.wait(batch_id, max(0.0, min(POLL_S, left)))
            if all(st.state is not TransferState.PENDING for st in statuses):
                with contextlib.suppress(Exception):
                    eng.free_batch(batch_id)
                return statuses, ""
            if give_up is not None and give_up():
                self._abandon(batch_id)
                return None, "request aborted while its KV was being written"
            if left <= 0:
                self._abandon(batch_id)
                return None, (f"KV write not done in {timeout_s:.0f} s (decode host "
                              f"unreachable?)")

    def wait_for(self, batch_id: Any, request_ids: Sequence[str], timeout_s: float,
                 failed: Callable[[str], bool] | None = None) -> tuple[list[Any] | None, str]:
        """``wait`` giving up once every one of ``request_ids`` is cancelled (or
        ``failed(request_id)``: already failed by an earlier batch)."""
        def give_up() -> bool:
            return bool(request_ids) and all(
                rid in self._cancelled or (failed is not None and failed(rid))
                for rid in request_ids)
        return self.wait(batch_id, timeout_s, give_up)

    def poll(self, batch_id: Any, timeout_s: float) -> list[Any] | None:
        """The batch's statuses once every request of it is final (the batch is freed),
        waiting at most ``timeout_s``; ``None`` while still pending (nothing changes)."""
        from pymooncake.transfer import TransferState
        statuses = self.engine.wait(batch_id, timeout_s)
        if any(st.state is TransferState.PENDING for st in statuses):
            return None
        with contextlib.suppress(Exception):
            self.engine.free_batch(batch_id)
        return statuses

    def defer(self, batch_id: Any, request_ids: Sequence[str], deadline: float,
              on_outcome: Callable[[list[Any] | None, str], None],
              on_final: Callable[[], None],
              failed: Callable[[str], bool] | None = None) -> None:
        """Leave a pending batch to the watcher thread (the engine thread moves on):
        ``on_outcome(statuses, "")`` when it ends, or ``on_outcome(None, why)`` once it is
        given up (every request cancelled or ``failed``, or ``deadline`` passed, monotonic);
        ``on_final()`` once every request of it is final and it is freed — only then may
        the memory it reads be reused. Both run on the watcher thread."""
        d = _Deferred(batch_id, tuple(request_ids), deadline, on_outcome, on_final, failed)
        with self._lock:
            self._deferred.append(d)
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch, daemon=True,
                                                 name="kv-write-watcher")
                self._watcher.start()
        self._wake.set()

    def _watch(self) -> None:
        from pymooncake.transfer import TransferState
        while not self._closed:
            with self._lock:
                items = list(self._deferred)
            if not items:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            for d in items:
                try:
                    statuses = self.engine.statuses(d.batch_id)
                    final = all(st.state is not TransferState.PENDING for st in statuses)
                except Exception:  # noqa: BLE001 - engine closed: nothing in flight any more
                    statuses, final = [], True
                if final:
                    if not d.told:
                        d.on_outcome(statuses or None, "" if statuses else "engine closed")
                    with contextlib.suppress(Exception):
                        self.engine.free_batch(d.batch_id)
                    with self._lock:
                        self._deferred.remove(d)
                    d.on_final()
                elif not d.told and (time.monotonic() > d.deadline or all(
                        rid in self._cancelled or (d.failed is not None and d.failed(rid))
                        for rid in d.request_ids)):
                    d.told = True
                    self.num_abandoned += 1
                    d.on_outcome(None, "request aborted while its KV was being written"
                                 if time.monotonic() <= d.deadline else
                                 "KV write not done in time (decode host unreachable?)")
            time.sleep(POLL_S / 2)

    # -- batches given up ------------------------------------------------------------------
    def _abandon(self, batch_id: Any) -> None:
        self.num_abandoned += 1
        with self._lock:
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._reap, daemon=True,
                                                name="kv-write-reaper")
                self._reaper.start()
        self._abandoned.put(batch_id)

    def _reap(self) -> None:
        while True:
            bid = self._abandoned.get()
            if bid is None:
                return
            try:
                self.engine.wait(bid, None)     # every slice ends within failure_bound_s
                self.engine.free_batch(bid)
            except Exception as e:  # noqa: BLE001 - engine closed meanwhile: nothing to free
                logger.debug("kv write batch %s not freed: %s", bid, e)

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        with self._lock:
            if self._reaper is not None:
                self._abandoned.put(None)


@dataclass(slots=True, eq=False)
class _Deferred:
    batch_id: Any
    request_ids: tuple[str, ...]
    deadline: float
    on_outcome: Callable[[list[Any] | None, str], None]
    on_final: Callable[[], None]
    failed: Callable[[str], bool] | None
    told: bool = False
