"""Replica copy/move tasks of ``MooncakeDistributedStore`` (``create_copy_task``,
``create_move_task``, ``query_task``) and exact replica placement.

Mooncake's master schedules these tasks on its clients and adds or drops single replicas in
place. pymooncake's master neither schedules tasks nor edits one replica of a live object,
so the facade runs each task on a worker thread of the client that created it: it reads
the object and re-puts it with the wanted replica set (remove, then put with
``replica_num`` = the set's size and the set's first segment preferred; when the master
places the remaining replicas elsewhere the put is redone, a few times at most). A reader in
between sees a miss, never mixed bytes. Validation and codes are Mooncake's: a missing key is
-704 (OBJECT_NOT_FOUND), an unknown segment or a move onto its own source -600."""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from pymooncake.store.compat._codes import INVALID_PARAMS, NOT_FOUND, OK, code
from pymooncake.store.compat._types import ReplicateConfig, TaskStatus, TaskType
from pymooncake.store.errors import ErrorCode, StoreError

TASK_NOT_FOUND = -1400
_PLACE_TRIES = 8
_NO_TASK = (0, 0)


class QueryTaskResponse:
    """A task's state, as ``query_task`` reports it (read-only fields)."""

    __slots__ = ("id", "type", "status", "created_at_ms_epoch", "last_updated_at_ms_epoch",
                 "assigned_client", "message")

    def __init__(self, task_id: tuple[int, int], task_type: TaskType, client: str) -> None:
        now = int(time.time() * 1000)
        self.id, self.type, self.status = task_id, task_type, TaskStatus.PENDING
        self.created_at_ms_epoch = self.last_updated_at_ms_epoch = now
        self.assigned_client, self.message = client, ""

    def _set(self, status: TaskStatus, message: str = "") -> None:
        self.status, self.message = status, message
        self.last_updated_at_ms_epoch = int(time.time() * 1000)

    def __repr__(self) -> str:
        return (f"QueryTaskResponse(id={self.id}, type={self.type}, status={self.status}, "
                f"assigned_client={self.assigned_client!r}, message={self.message!r})")


class TaskMethods:
    """Mixed into ``MooncakeDistributedStore``."""

    client: Any
    get_hostname: Any

    def __init__(self) -> None:
        self._tasks: dict[tuple[int, int], QueryTaskResponse] = {}
        self._task_q: queue.Queue[Any] = queue.Queue()
        self._task_thread: threading.Thread | None = None
        self._task_ids = itertools.count(1)
        self._task_lock = threading.Lock()

    # -- placement ---------------------------------------------------------------------

    def _segments(self) -> set[str]:
        return set(self.client.stats().get("fragmentation", {}))

    def _replica_segments(self, key: str) -> list[str] | None:
        """Segments holding a memory replica of ``key`` (None when missing). Takes no read
        lease that outlives the call."""
        try:
            rl = self.client.replica_list(key)
        except StoreError as e:
            if e.code == ErrorCode.OBJECT_NOT_FOUND:
                return None
            raise
        with contextlib.suppress(StoreError):
            self.client.release_leases([key])
        return [r.segment for r in rl.replicas]

    def _place_exact(self, key: str, value: bytes, segments: Sequence[str],
                     config: ReplicateConfig | None) -> int:
        """Store ``value`` under ``key`` (which must not exist) with one replica on each of
        ``segments``; redone while the master places a replica elsewhere."""
        want = sorted(set(segments))
        base = config if config is not None else ReplicateConfig()
        typed = base.to_typed()
        from dataclasses import replace

        cfg = replace(typed, replica_num=len(want), preferred_segment=want[0])
        for attempt in range(_PLACE_TRIES):
            errs = self.client.batch_put([key], [value], cfg)
            if errs[0] is not None:
                return code(errs[0])
            got = self._replica_segments(key)
            if got is not None and sorted(got) == want:
                return OK
            if attempt + 1 < _PLACE_TRIES:
                self.client.remove(key, force=True)
        return OK  # best effort, as Mooncake's placement

    def _replace(self, key: str, segments: Sequence[str]) -> None:
        """Re-store ``key`` with its replicas on ``segments`` (raises ``StoreError``)."""
        value = self.client.get(key)
        self._release(key)
        self.client.remove(key, force=True)
        rc = self._place_exact(key, value, segments, None)
        if rc != OK:
            raise StoreError(ErrorCode(rc), f"re-put of {key!r} failed")

    def _release(self, key: str) -> None:
        with contextlib.suppress(StoreError):
            self.client.release_leases([key])

    # -- tasks -------------------------------------------------------------------------

    def _new_task(self, task_type: TaskType, key: str, segments: list[str]
                  ) -> tuple[tuple[int, int], int]:
        task_id = (os.getpid(), next(self._task_ids))
        resp = QueryTaskResponse(task_id, task_type, self.get_hostname())
        with self._task_lock:
            self._tasks[task_id] = resp
            if self._task_thread is None:
                self._task_thread = threading.Thread(target=self._task_main, daemon=True,
                                                     name="compat-store-tasks")
                self._task_thread.start()
        self._task_q.put((resp, key, segments))
        return task_id, OK

    def _task_main(self) -> None:
        while True:
            item = self._task_q.get()
            if item is None:
                return
            resp, key, segments = item
            resp._set(TaskStatus.PROCESSING)
            try:
                current = self._replica_segments(key)
                if current is None:
                    resp._set(TaskStatus.FAILED, "object not found")
                    continue
                if sorted(set(current)) != sorted(set(segments)):
                    self._replace(key, segments)
                resp._set(TaskStatus.SUCCESS)
            except Exception as e:  # noqa: BLE001 - reported through query_task
                resp._set(TaskStatus.FAILED, f"{type(e).__name__}: {e}")

    def _stop_tasks(self) -> None:
        if self._task_thread is not None:
            self._task_q.put(None)
            self._task_thread.join(30)
            self._task_thread = None

    def _check(self, key: str, segments: Sequence[str]) -> tuple[list[str] | None, int]:
        try:
            current = self._replica_segments(key)
            if current is None:
                return None, NOT_FOUND
            known = self._segments()
        except Exception as e:  # noqa: BLE001
            return None, code(e)
        if not segments or any(s not in known for s in segments):
            return None, INVALID_PARAMS
        return current, OK

    def create_copy_task(self, key: str, targets: Sequence[str]
                         ) -> tuple[tuple[int, int], int]:
        """Adds a replica of ``key`` on each target segment: ``(task_id, 0)``, or
        ``((0, 0), code)``: -704 missing key, -600 unknown or no target."""
        if isinstance(targets, str):
            raise TypeError("targets must be a list of segment names")
        current, rc = self._check(key, list(targets))
        if current is None:
            return _NO_TASK, rc
        return self._new_task(TaskType.REPLICA_COPY, key,
                              list(dict.fromkeys([*current, *targets])))

    def create_move_task(self, key: str, source: str, target: str
                         ) -> tuple[tuple[int, int], int]:
        """Moves ``key``'s replica from ``source`` to ``target``: ``(task_id, 0)``, or
        ``((0, 0), code)``: -704 missing key, -600 unknown segment, source == target, or no
        replica on ``source``."""
        current, rc = self._check(key, [source, target])
        if current is None:
            return _NO_TASK, rc
        if source == target or source not in current:
            return _NO_TASK, INVALID_PARAMS
        wanted = [s for s in current if s != source]
        return self._new_task(TaskType.REPLICA_MOVE, key,
                              list(dict.fromkeys([*wanted, target])))

    def query_task(self, task_id: Any) -> tuple[QueryTaskResponse | None, int]:
        """``(response, 0)``, or ``(None, -1400)`` (TASK_NOT_FOUND) for an unknown id."""
        try:
            tid = (int(task_id[0]), int(task_id[1]))
        except (TypeError, ValueError, IndexError):
            return None, INVALID_PARAMS
        resp = self._tasks.get(tid)
        return (resp, OK) if resp is not None else (None, TASK_NOT_FOUND)
