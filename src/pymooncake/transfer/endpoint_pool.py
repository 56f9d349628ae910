"""Endpoint pool: connections opened on first use, capped, evicted with SIEVE.

SIEVE (Zhang et al., NSDI'24): entries sit in a FIFO queue, newest at the head, each with a
``visited`` bit set on a hit. To evict, a hand walks from where it stopped (initially the
tail, the oldest entry) towards the head, clearing ``visited`` bits, and evicts the first
entry whose bit is clear; the hand then rests on that entry's newer neighbour and wraps
to the tail after the head::

    head (newest) ──► [D] [C*] [B] [A*] ◄── tail (oldest)      * = visited
    evict: hand at A* → clear, move to B → B evicted, hand rests at C*
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass(slots=True, eq=False)
class _Node(Generic[K]):
    key: K
    visited: bool = False
    newer: _Node[K] | None = None
    older: _Node[K] | None = None


class SieveCache(Generic[K]):
    """The SIEVE eviction order over keys; pure (no I/O), not thread-safe."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._nodes: dict[K, _Node[K]] = {}
        self._head: _Node[K] | None = None
        self._tail: _Node[K] | None = None
        self._hand: _Node[K] | None = None

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: object) -> bool:
        return key in self._nodes

    def keys_newest_first(self) -> list[K]:
        out, n = [], self._head
        while n is not None:
            out.append(n.key)
            n = n.older
        return out

    def access(self, key: K) -> bool:
        """Mark a hit; ``False`` when ``key`` is not cached."""
        node = self._nodes.get(key)
        if node is None:
            return False
        node.visited = True
        return True

    def insert(self, key: K) -> K | None:
        """Add ``key`` at the head; returns the evicted key when the cache was full."""
        if key in self._nodes:
            raise KeyError(f"{key!r} is already cached")
        evicted = self._evict() if len(self._nodes) >= self.capacity else None
        node = _Node(key, older=self._head)
        if self._head is not None:
            self._head.newer = node
        self._head = node
        if self._tail is None:
            self._tail = node
        self._nodes[key] = node
        return evicted

    def remove(self, key: K) -> bool:
        node = self._nodes.pop(key, None)
        if node is None:
            return False
        if self._hand is node:
            self._hand = node.newer
        if node.newer is not None:
            node.newer.older = node.older
        else:
            self._head = node.older
        if node.older is not None:
            node.older.newer = node.newer
        else:
            self._tail = node.newer
        return True

    def _evict(self) -> K:
        node = self._hand or self._tail
        assert node is not None, "evict from an empty SIEVE cache"
        while node.visited:
            node.visited = False
            node = node.newer or self._tail
            assert node is not None
        key = node.key
        self._hand = node.newer
        self.remove(key)
        return key


E = TypeVar("E")


@dataclass(slots=True, eq=False)
class _Entry(Generic[E]):
    endpoint: E
    users: int = 0


class EndpointPool(Generic[K, E]):
    """Thread-safe pool of endpoints (e.g. sockets) keyed by ``(peer, path)``.

    ``acquire(key, open_fn)`` returns a pooled endpoint or opens one with ``open_fn()``
    (outside the lock); when the pool is over ``capacity`` the SIEVE victim is closed with
    ``close_fn`` (at once, or when its current user releases it). ``discard`` drops an
    endpoint after a link error so the next ``acquire`` opens a fresh one.
    """

    def __init__(self, capacity: int, close_fn: Callable[[E], None]) -> None:
        self._sieve: SieveCache[K] = SieveCache(capacity)
        self._entries: dict[K, _Entry[E]] = {}
        self._close = close_fn
        self._lock = threading.Lock()
        self.num_evictions = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def acquire(self, key: K, open_fn: Callable[[], E]) -> tuple[E, bool]:
        """``(endpoint, reused)``; ``reused`` is False for a freshly opened endpoint.

        Raises whatever ``open_fn`` raises (e.g. ``ConnectionRefusedError``).
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._sieve.access(key)
                entry.users += 1
                return entry.endpoint, True
        endpoint = open_fn()
        to_close: list[E] = []
        with self._lock:
            if key in self._entries:  # another thread opened it meanwhile; keep theirs
                to_close.append(endpoint)
                entry = self._entries[key]
                self._sieve.access(key)
                reused = True
            else:
                victim = self._sieve.insert(key)
                if victim is not None:
                    self.num_evictions += 1
                    ventry = self._entries.pop(victim)
                    if ventry.users == 0:
                        to_close.append(ventry.endpoint)
                entry = self._entries[key] = _Entry(endpoint)
                reused = False
            entry.users += 1
            result = entry.endpoint
        for ep in to_close:
            self._close(ep)
        return result, reused

    def release(self, key: K, endpoint: E) -> None:
        """Hand the endpoint back; closes it if it was evicted while in use."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.endpoint is endpoint:
                entry.users -= 1
                return
        self._close(endpoint)  # evicted or discarded while in use

    def discard(self, key: K, endpoint: E) -> None:
        """Drop and close ``endpoint`` (a link error); a no-op if already replaced."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.endpoint is endpoint:
                del self._entries[key]
                self._sieve.remove(key)
        self._close(endpoint)

    def close_all(self) -> None:
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
            self._sieve = SieveCache(self._sieve.capacity)
        for e in entries:
            self._close(e.endpoint)
