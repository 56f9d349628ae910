"""``KVEventLog``: the KV events a worker owes the Conductor until its next load report.

Two streams, each of block keys stored and removed: this worker's own prefix cache (the
engine's ``BlockStored`` / ``BlockRemoved`` events, reported under the worker's id) and
the global Store (keys this worker put or found evicted, reported under ``store``). The
engine thread and the Store's put thread add; the report loop on the event loop takes all
at once (``EngineWorker._report_loop``), so every method holds one lock. DESIGN.md §1:
the Conductor's prefix index is built from these events.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any


class KVEventLog:
    """Block keys stored and removed since the last ``take``, per stream (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stored: list[Any] = []
        self._removed: list[Any] = []
        self._store_stored: list[str] = []
        self._store_removed: list[str] = []

    def add_engine(self, events: Iterable[Any]) -> None:
        """The engine's ``BlockStored`` / ``BlockRemoved`` events (``pool.take_events``)."""
        from pymooncake.engine.kv.block_pool import BlockStored
        with self._lock:
            for ev in events:
                (self._stored if isinstance(ev, BlockStored) else self._removed).extend(
                    ev.block_keys)

    def resend_stored(self, keys: list[Any]) -> None:
        """After a (re)registration: the whole prefix cache, ahead of what is pending."""
        with self._lock:
            self._stored = keys + self._stored

    def add_store(self, keys: list[str]) -> None:
        with self._lock:
            self._store_stored.extend(keys)

    def drop_store(self, keys: list[str]) -> None:
        with self._lock:
            self._store_removed.extend(keys)

    def take(self) -> tuple[list[Any], list[Any], list[str], list[str]]:
        """Everything pending, emptied: (stored, removed, Store stored, Store removed)."""
        with self._lock:
            out = (self._stored, self._removed, self._store_stored, self._store_removed)
            self._stored, self._removed, self._store_stored, self._store_removed = (
                [], [], [], [])
        return out
