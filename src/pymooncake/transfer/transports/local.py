"""``local`` and ``shm`` transports: one memcpy between two mapped ranges.

``local`` copies between ranges of the same engine; ``shm`` between this process's
registered range and a same-host peer's shared-memory range mapped here
(:class:`~pymooncake.transfer.memory.PeerMapping`). ``ctypes.memmove`` releases the GIL.

:class:`LocalCopier` makes these copies asynchronous: ``submit`` hands them to the
engine's copy thread and returns at once, so the caller's thread (an engine computing the
next layer) runs while the bytes move. A caller that blocks for the result anyway
(``batch_transfer_sync``) copies in its own thread with :func:`copy` instead of handing
the work over and sleeping until it is done.
"""

from __future__ import annotations

import ctypes
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pymooncake.obs.logging import init_logger
from pymooncake.transfer.batch import TransferOp

logger = init_logger(__name__)


def copy(op: TransferOp, local_addr: int, target_addr: int, length: int) -> None:
    """WRITE: local → target; READ: target → local. Both ranges were checked by the caller."""
    if length <= 0:
        return
    if op is TransferOp.WRITE:
        ctypes.memmove(target_addr, local_addr, length)
    else:
        ctypes.memmove(local_addr, target_addr, length)


@dataclass(slots=True, frozen=True)
class CopyJob:
    """One request's copy; ``batch_id``/``index`` say whom to report it to."""

    op: TransferOp
    local_addr: int
    target_addr: int
    length: int
    batch_id: int
    index: int
    transport: str


Done = Callable[[Sequence[CopyJob], str], None]
"""Called on the copy thread with the jobs just finished (``""``) or failed (a reason)."""


class LocalCopier:
    """One copy thread per engine (started on first use); jobs run in submission order.

    Finished jobs are reported in groups: everything taken off the queue in one go is
    reported with one call, so a batch of many small copies costs one wake-up.
    """

    def __init__(self, name: str, done: Done) -> None:
        self._name = name
        self._done = done
        self._queue: queue.SimpleQueue[list[CopyJob] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, jobs: list[CopyJob]) -> None:
        if not jobs:
            return
        if self._thread is None:
            with self._lock:
                if self._closed:
                    self._done(jobs, "engine closed")
                    return
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, daemon=True,
                                                    name=f"transfer-copy-{self._name}")
                    self._thread.start()
        self._queue.put(jobs)

    def close(self) -> None:
        """Stop the thread after the queued copies (they still run: the memory is live)."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout=10)

    def _loop(self) -> None:
        q = self._queue
        while True:
            first = q.get()
            if first is None:
                return
            groups = [first]
            stop = False
            while True:  # take everything queued meanwhile
                try:
                    more = q.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                groups.append(more)
            for jobs in groups:
                try:
                    for j in jobs:
                        copy(j.op, j.local_addr, j.target_addr, j.length)
                except Exception as e:  # noqa: BLE001 - report, keep the thread alive
                    logger.error("local copy failed: %r", e)
                    self._done(jobs, f"local copy failed: {e!r}")
                    continue
                self._done(jobs, "")
            if stop:
                return
