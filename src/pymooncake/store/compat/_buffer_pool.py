"""``BufferPool``: Mooncake's pool of registered buffers for zero-copy ``put_from`` /
``get_into``, over a compat store.

Leases come first from a region the size of the store's ``local_buffer_size`` (registered
with the store once), then from "overflow" buffers allocated with ``alignment`` and
registered one by one, up to ``max_bytes`` in all (default twice the local buffer) and
``max_regions`` leases. ``acquire`` blocks (or raises "buffer pool is exhausted") when full.
A lease's ``buffer`` is a memoryview of its bytes; ``release`` refuses while such a view is
alive ("exported views"), a lease garbage-collected unreleased is returned to the pool, and
``close`` refuses while leases are active. Errors are ``RuntimeError`` with Mooncake's
messages."""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
import weakref
from typing import Any

import numpy as np

from pymooncake.store.tiers.dram_segment import OffsetAllocator


class BufferLease:
    """``ptr``, ``size``, ``buffer`` (memoryview), ``release()``; a context manager."""

    def __init__(self, pool: BufferPool, ptr: int, size: int, region: Any) -> None:
        self._pool: BufferPool | None = pool
        self._ptr, self.size, self._region = ptr, size, region
        self._views: list[weakref.ref[np.ndarray]] = []

    @property
    def ptr(self) -> int:
        if self._pool is None:
            raise RuntimeError("buffer lease is closed")
        return self._ptr

    @property
    def buffer(self) -> memoryview:
        if self._pool is None:
            raise RuntimeError("buffer lease is closed")
        raw = (ctypes.c_uint8 * self.size).from_address(self._ptr) if self.size else b""
        arr = np.frombuffer(raw, dtype=np.uint8) if self.size else np.zeros(0, np.uint8)
        self._views = [v for v in self._views if v() is not None]
        self._views.append(weakref.ref(arr))
        return memoryview(arr)

    def release(self) -> None:
        self._release(check_views=True)

    def _release(self, check_views: bool) -> None:
        if self._pool is None:
            return
        if check_views and any(v() is not None for v in self._views):
            raise RuntimeError("cannot release buffer while exported views exist")
        pool, self._pool = self._pool, None
        pool._give_back(self._ptr, self._region)

    def __enter__(self) -> BufferLease:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # never raise from a finaliser
            self._release(check_views=False)


class BufferPool:
    def __init__(self, store: Any, max_bytes: int = 0, min_size_class: int = 64 * 1024,
                 max_size_class: int | None = None, alignment: int = 8 << 20,
                 block_on_exhaustion: bool = True, default_timeout: float | None = None,
                 max_regions: int | None = None, prewarm_size: int | None = None,
                 prewarm_count: int = 0) -> None:
        if store is None or getattr(store, "_client", None) is None:
            raise RuntimeError("MooncakeDistributedStore is not initialized")
        if min_size_class <= 0 or alignment <= 0:
            raise RuntimeError("min_size_class and alignment must be positive")
        if alignment < 8 or alignment & (alignment - 1):
            raise RuntimeError("alignment must be a power of two and at least sizeof(void*)")
        local = int(getattr(store, "_local_buffer_size", 0))
        if local <= 0:
            raise RuntimeError("BufferPool requires a store configured with a local buffer")
        self._store, self._alignment = store, alignment
        self._max_bytes = local * 2 if max_bytes == 0 else max(max_bytes, local)
        self._max_size_class = self._max_bytes if max_size_class is None else max_size_class
        self._block, self._timeout = block_on_exhaustion, default_timeout
        self._max_regions = max_regions
        self._local = np.zeros(local + 4096, dtype=np.uint8)  # base aligned to a page
        self._local_base = int(self._local.ctypes.data) + (-int(self._local.ctypes.data)
                                                           % 4096)
        if store.register_buffer(self._local_base, local) != 0:
            raise RuntimeError("local buffer registration failed")
        self._alloc = OffsetAllocator(local, alignment=64)
        self._cond = threading.Condition()
        self._in_use: dict[int, int] = {}  # ptr -> bytes
        self._total = 0
        self._closed = False

    def _try(self, size: int) -> tuple[int, Any] | None:
        if self._closed:
            raise RuntimeError("buffer pool is closed")
        if self._total + size > self._max_bytes or (
                self._max_regions is not None and len(self._in_use) >= self._max_regions):
            return None
        off = self._alloc.allocate(size)
        if off is not None:
            ptr, region = self._local_base + off, ("local", off)
        else:  # an overflow buffer, aligned and registered on its own
            raw = np.zeros(size + self._alignment, dtype=np.uint8)
            skew = -int(raw.ctypes.data) % self._alignment
            ptr = int(raw.ctypes.data) + skew
            if self._store.register_buffer(ptr, size) != 0:
                raise RuntimeError("overflow buffer registration failed")
            region = ("overflow", raw)
        self._in_use[ptr] = size
        self._total += size
        return ptr, region

    def acquire(self, size: int, block: bool | None = None, timeout: float | None = None
                ) -> BufferLease:
        """A lease of ``size`` bytes (0 allowed) of registered memory."""
        if size < 0:
            raise RuntimeError("size must be non-negative")
        should_block = self._block if block is None else block
        t = self._timeout if timeout is None else timeout
        if t is not None and t < 0:
            raise RuntimeError("timeout must be non-negative")
        n = max(int(size), 1)
        if n > self._max_bytes:
            raise RuntimeError("requested buffer size exceeds pool capacity")
        deadline = None if t is None else time.monotonic() + t
        with self._cond:
            while True:
                got = self._try(n)
                if got is not None:
                    return BufferLease(self, got[0], int(size), got[1])
                if not should_block:
                    raise RuntimeError("buffer pool is exhausted")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise RuntimeError("timed out waiting for buffer")
                self._cond.wait(left)

    def buffer(self, size: int, block: bool | None = None, timeout: float | None = None
               ) -> memoryview:
        return self.acquire(size, block, timeout).buffer

    def prewarm(self, size: int, count: int) -> None:
        """Accepted; nothing to do (leases are carved on demand, as Mooncake's)."""

    def _give_back(self, ptr: int, region: Any) -> None:
        with self._cond:
            size = self._in_use.pop(ptr, None)
            if size is None:
                raise RuntimeError("buffer lease is not active")
            self._total -= size
            if region[0] == "local":
                self._alloc.free(region[1])
            else:
                self._store.unregister_buffer(ptr)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            if self._in_use:
                raise RuntimeError("cannot close buffer pool with active leases")
            self._closed = True
            self._cond.notify_all()
        if self._store._client is not None:
            self._store.unregister_buffer(self._local_base)
