"""In-process metadata backend (``embedded://[name]``), the default for single-process use.

All handles opened with the same name in one process share one :class:`KvState`; it is
guarded by a lock so handles may be used from any thread and any event loop. A reaper
thread expires leases on time so watchers see expiries without any other traffic.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pymooncake.metadata.base import KeyValue, LeaseId, WatchEvent
from pymooncake.metadata.core import KvState

_STATES: dict[str, SharedState] = {}
_STATES_LOCK = threading.Lock()


@dataclass(slots=True, eq=False)
class _Watcher:
    prefix: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[WatchEvent | None]


class SharedState:
    """A :class:`KvState` under a lock, with watcher fan-out and a lease reaper thread."""

    def __init__(self) -> None:
        self.kv = KvState()
        self.lock = threading.Condition()
        self.watchers: list[_Watcher] = []
        self._reaper: threading.Thread | None = None

    def run(self, fn, *args):  # noqa: ANN001, ANN202
        with self.lock:
            before = self.kv.revision
            deadline_before = self.kv.next_deadline_s()
            result = fn(*args, time.monotonic())
            events = self.kv.events_since(before, "") if self.kv.revision > before else []
            self._publish(events)
            deadline = self.kv.next_deadline_s()
            if deadline is not None:
                self._ensure_reaper()
            # wake the long-polls for events, the reaper only when it must wake sooner:
            # a keep-alive (later deadline) wakes nobody
            if events or (deadline is not None and (deadline_before is None
                                                    or deadline < deadline_before)):
                self.lock.notify_all()
            return result

    def _publish(self, events: list[WatchEvent]) -> None:
        for ev in events:
            for w in list(self.watchers):
                if ev.key.startswith(w.prefix):
                    try:
                        w.loop.call_soon_threadsafe(w.queue.put_nowait, ev)
                    except RuntimeError:  # the watcher's loop is closed
                        self.watchers.remove(w)

    def _ensure_reaper(self) -> None:
        if self._reaper is None or not self._reaper.is_alive():
            self._reaper = threading.Thread(target=self._reap, name="metadata-reaper",
                                            daemon=True)
            self._reaper.start()

    def _reap(self) -> None:
        with self.lock:
            while True:
                deadline = self.kv.next_deadline_s()
                if deadline is None:
                    self._reaper = None
                    return
                wait_s = deadline - time.monotonic()
                if wait_s > 0:
                    self.lock.wait(timeout=wait_s)
                    continue
                self._publish(self.kv.expire(time.monotonic()))
                self.lock.notify_all()


def _shared(name: str) -> SharedState:
    with _STATES_LOCK:
        st = _STATES.get(name)
        if st is None:
            st = _STATES[name] = SharedState()
        return st


class _EmbeddedWatch:
    def __init__(self, state: SharedState, watcher: _Watcher) -> None:
        self._state = state
        self._watcher = watcher
        self._closed = False

    def __aiter__(self) -> _EmbeddedWatch:
        return self

    async def __anext__(self) -> WatchEvent:
        if self._closed:
            raise StopAsyncIteration
        ev = await self._watcher.queue.get()
        if ev is None:
            raise StopAsyncIteration
        return ev

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            with self._state.lock:
                if self._watcher in self._state.watchers:
                    self._state.watchers.remove(self._watcher)
            self._watcher.queue.put_nowait(None)


class EmbeddedMetadata:
    """Metadata kept in this process (see :class:`~pymooncake.metadata.base.MetadataStore`).

    ``EmbeddedMetadata("x")`` handles share state with every other handle named ``"x"``
    in the same process; other processes cannot see it (use ``http`` or ``etcd`` there).
    """

    def __init__(self, name: str = "default") -> None:
        self.name = name
        self.url = f"embedded://{name}"
        self._state = _shared(name)

    async def get(self, key: str) -> KeyValue | None:
        return self._state.run(self._state.kv.get, key)

    async def get_prefix(self, prefix: str) -> list[KeyValue]:
        return self._state.run(self._state.kv.get_prefix, prefix)

    async def put(self, key: str, value: bytes, *, lease_id: LeaseId | None = None) -> int:
        return self._state.run(lambda now: self._state.kv.put(key, value, now, lease_id))

    async def create(self, key: str, value: bytes, *, lease_id: LeaseId | None = None) -> bool:
        return self._state.run(lambda now: self._state.kv.create(key, value, now, lease_id))

    async def delete(self, key: str) -> bool:
        return self._state.run(self._state.kv.delete, key)

    async def guarded_write(self, guard_key: str, guard_revision: int,
                            puts: Sequence[tuple[str, bytes]] = (),
                            deletes: Sequence[str] = ()) -> int | None:
        return self._state.run(lambda now: self._state.kv.guarded_write(
            guard_key, guard_revision, list(puts), list(deletes), now))

    async def grant_lease(self, ttl_s: float) -> LeaseId:
        return self._state.run(self._state.kv.grant_lease, ttl_s)

    async def keep_alive(self, lease_id: LeaseId) -> None:
        self._state.run(self._state.kv.keep_alive, lease_id)

    async def revoke_lease(self, lease_id: LeaseId) -> None:
        self._state.run(self._state.kv.revoke_lease, lease_id)

    async def watch_prefix(self, prefix: str) -> _EmbeddedWatch:
        watcher = _Watcher(prefix, asyncio.get_running_loop(), asyncio.Queue())
        with self._state.lock:
            self._state.watchers.append(watcher)
        return _EmbeddedWatch(self._state, watcher)

    async def close(self) -> None:
        return None
