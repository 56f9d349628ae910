"""SSD tier: objects spilled from DRAM into files under one directory, LRU-bounded.

Each object is one file named by the BLAKE3 hash of its key (keys may hold any
character), written to a temporary name and renamed into place, so a crash or a refused
write never leaves a partial object. The tier holds at most ``capacity_bytes`` of object
bytes: with the default ``eviction_policy="lru"`` a write that does not fit first drops
the least-recently used objects (reads refresh recency) and reports them, so the master
forgets them; with ``"none"`` such a write is refused (``SsdFull``) and nothing is written.
(Case BUG-26: a tier without eviction by default fills the disk and every write fails.)

The methods are blocking file I/O and thread-safe; the storage process calls them through
``asyncio.to_thread`` (``aput``/``aget``/``aremove``) so the event loop never blocks.
On start the directory's previous objects are deleted: without a master snapshot nobody
could name them (documented in docs/store.md; case BUG-31).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections import OrderedDict
from pathlib import Path

import blake3

SSD_EVICTION_POLICIES: tuple[str, ...] = ("lru", "none")
_SUFFIX = ".obj"


class SsdFull(Exception):
    """A write does not fit and the tier's policy forbids eviction (``NO_SPACE``)."""


class SsdTier:
    """Spill files under ``path``, at most ``capacity_bytes`` of object bytes in total.

    ``put(key, data)`` → keys evicted to make room (oldest first); raises ``SsdFull`` when
    ``data`` is larger than the tier or the policy is ``"none"`` and it does not fit, and
    ``ValueError`` for an empty key. ``get(key)`` → the exact bytes, or ``None`` when
    absent. Never returns partial bytes: a file whose size disagrees with the index is
    dropped and reported absent.
    """

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int,
                 eviction_policy: str = "lru") -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes={capacity_bytes}: must be > 0 "
                             "(pass --ssd-capacity BYTES)")
        if eviction_policy not in SSD_EVICTION_POLICIES:
            raise ValueError(f"eviction_policy={eviction_policy!r}: choose one of "
                             f"{', '.join(SSD_EVICTION_POLICIES)}")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.eviction_policy = eviction_policy
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> size, LRU first
        self._lock = threading.Lock()
        self.used_bytes = 0
        self.num_evictions = 0
        for p in self.path.iterdir():
            if p.suffix in (_SUFFIX, ".tmp") and p.is_file():
                p.unlink()

    def _file(self, key: str) -> Path:
        return self.path / (blake3.blake3(key.encode()).hexdigest()[:40] + _SUFFIX)

    def put(self, key: str, data: bytes | memoryview) -> list[str]:
        if not key:
            raise ValueError("empty key")
        size = len(data)
        if size > self.capacity_bytes:
            raise SsdFull(f"object of {size} bytes exceeds SSD capacity {self.capacity_bytes}")
        evicted: list[str] = []
        with self._lock:
            if key in self._index:
                self._drop(key)
            if self.used_bytes + size > self.capacity_bytes:
                if self.eviction_policy == "none":
                    raise SsdFull(f"SSD tier full ({self.used_bytes}/{self.capacity_bytes} "
                                  f"bytes) and eviction_policy='none'")
                while self.used_bytes + size > self.capacity_bytes and self._index:
                    old = next(iter(self._index))
                    self._drop(old)
                    evicted.append(old)
                    self.num_evictions += 1
            final = self._file(key)
            tmp = final.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, final)
            self._index[key] = size
            self.used_bytes += size
        return evicted

    def _drop(self, key: str) -> None:
        size = self._index.pop(key)
        self.used_bytes -= size
        with contextlib.suppress(FileNotFoundError):
            self._file(key).unlink()

    def get(self, key: str) -> bytes | None:
        with self._lock:
            size = self._index.get(key)
            if size is None:
                return None
            self._index.move_to_end(key)
            try:
                data = self._file(key).read_bytes()
            except FileNotFoundError:
                data = b""
            if len(data) != size:
                self._drop(key)
                return None
            return data

    def remove(self, key: str) -> bool:
        with self._lock:
            if key not in self._index:
                return False
            self._drop(key)
            return True

    def clear(self) -> None:
        with self._lock:
            for key in list(self._index):
                self._drop(key)

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._index)

    async def aput(self, key: str, data: bytes | memoryview) -> list[str]:
        return await asyncio.to_thread(self.put, key, data)

    async def aget(self, key: str) -> bytes | None:
        return await asyncio.to_thread(self.get, key)

    async def aremove(self, key: str) -> bool:
        return await asyncio.to_thread(self.remove, key)
