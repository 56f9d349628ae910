"""``local``, ``shm`` and ``cma`` transports: one copy between two ranges on this host.

``local`` copies between ranges of the same engine; ``shm`` between this process's
registered range and a same-host peer's shared-memory range mapped here
(:class:`~pymooncake.transfer.memory.PeerMapping`); ``cma`` into or out of a same-host
peer's ordinary memory with one kernel copy (:mod:`.cma`). ``ctypes.memmove`` and the
``process_vm_*`` calls release the GIL.

:class:`LocalCopier` makes these copies asynchronous: ``submit`` hands them to the
engine's copy thread and returns at once, so the caller's thread (an engine computing the
next layer) runs while the bytes move. A caller that blocks for the result anyway
(``batch_transfer_sync``) copies in its own thread with :func:`run_copies` instead of handing
the work over and sleeping until it is done. So does a small submission while the copy
thread has nothing queued (``idle``, ``TransferConfig.inline_copy_max_bytes``): a memcpy of
a few hundred KiB takes less CPU than waking a thread for it and handing the GIL back.
"""

from __future__ import annotations

import ctypes
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pymooncake.obs.logging import init_logger
from pymooncake.transfer.batch import StatusCode, TransferOp
from pymooncake.transfer.transports import cma
from pymooncake.transfer.transports.cma import CmaPeer, CmaTable

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
    """One request's copy; ``batch_id``/``index`` say whom to report it to. ``peer`` is
    set for ``cma`` (``target_addr`` is then in the peer's address space)."""

    op: TransferOp
    local_addr: int
    target_addr: int
    length: int
    batch_id: int
    index: int
    transport: str
    peer: CmaPeer | None = None


Done = Callable[[Sequence[CopyJob], str, StatusCode], None]
"""Called with jobs just finished (``""``) or failed (a reason and its status code)."""


def run_copies(jobs: Sequence[CopyJob], done: Done) -> None:
    """Copy ``jobs`` in order and report each through ``done``: ``""`` or its failure's
    reason (never an exception). For ``cma`` (``transports.cma``): the owner's table of
    registered ranges is read once per run of jobs to it; a job outside it fails
    ``INVALID_ARGUMENT`` uncopied, as does every job when the process has exited (its pidfd,
    checked before each copy) or refuses; after a copy fails for the process rather than
    the range (``ESRCH``, ``EPERM``), the rest of the run to it is not tried."""
    ok: list[CopyJob] = []
    failed: dict[tuple[str, StatusCode], list[CopyJob]] = {}
    tables: dict[int, tuple[str, CmaTable]] = {}
    for j in jobs:
        reason, code = "", StatusCode.INTERNAL
        peer = j.peer
        try:
            if peer is None:
                copy(j.op, j.local_addr, j.target_addr, j.length)
            else:
                got = tables.get(id(peer))
                if got is None:
                    got = tables[id(peer)] = peer.table()
                reason, table = got
                if not reason and not table.covers(j.target_addr, j.length):
                    reason, code = (f"target range [{j.target_addr:#x}, +{j.length}) is "
                                    f"outside every range segment {peer.segment!r} has "
                                    "registered (its own record)"), StatusCode.INVALID_ARGUMENT
                elif not reason and not peer.alive():
                    reason = f"segment {peer.segment!r}: pid {peer.pid} has exited"
                elif not reason:
                    try:
                        cma.copy(peer.pid, j.op, j.local_addr, j.target_addr, j.length)
                    except cma.CmaError as e:
                        reason = f"segment {peer.segment!r}: {e}"
                        if e.errno in cma.PASS_ON:
                            tables[id(peer)] = (f"segment {peer.segment!r}: not tried after "
                                                f"an earlier copy of the same hand-off "
                                                f"failed ({e})", table)
        except Exception as e:  # noqa: BLE001 - a status, never a dead copy thread
            reason = f"{j.transport} copy failed: {e}"
        if reason:
            failed.setdefault((reason, code), []).append(j)
        else:
            ok.append(j)
    if ok:
        done(ok, "", StatusCode.OK)
    for (reason, code), group in failed.items():
        logger.error("%d %s cop%s failed: %s", len(group), group[0].transport,
                     "y" if len(group) == 1 else "ies", reason)
        done(group, reason, code)


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
        self._in_flight = 0
        """Submissions not yet reported (guarded by ``_lock``)."""

    def idle(self) -> bool:
        """No submitted copy is still queued or running: one made now cannot overtake
        any (submission order holds)."""
        return self._in_flight == 0

    def submit(self, jobs: list[CopyJob], inline_max_bytes: int = 0) -> None:
        """Copy ``jobs`` on the copy thread, or on this one when they total at most
        ``inline_max_bytes`` and nothing is queued (``idle``: no copy overtakes another).
        Either way they are reported through ``done``, a failure as their status."""
        if not jobs:
            return
        if inline_max_bytes and self.idle() and (
                sum(j.length for j in jobs) <= inline_max_bytes):
            self._run(jobs)   # cheaper than waking the copy thread
            return
        if self._thread is None:
            with self._lock:
                if self._closed:
                    self._done(jobs, "engine closed", StatusCode.INTERNAL)
                    return
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, daemon=True,
                                                    name=f"transfer-copy-{self._name}")
                    self._thread.start()
        with self._lock:
            self._in_flight += 1
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
                    self._run(jobs)
                finally:
                    with self._lock:
                        self._in_flight -= 1
            if stop:
                return

    def _run(self, jobs: list[CopyJob]) -> None:
        run_copies(jobs, self._done)
