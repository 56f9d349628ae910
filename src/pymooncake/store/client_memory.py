"""The Store client's memory: the segment it contributes, its staging buffer for bytes
values, and the user buffers registered for ``put_from``/``get_into``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from pymooncake.store.client_base import ClientBase
from pymooncake.store.errors import ErrorCode, StoreError

OVERFLOW_MAX_BYTES = 1 << 30
"""Largest value staged through the kept overflow buffer; larger ones get a one-off."""


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_lists(*lists: object) -> int:
    """The common length of the argument lists of a batch call, else ``INVALID_PARAMS``."""
    try:
        n = {len(x) for x in lists}  # type: ignore[arg-type]
    except TypeError:
        raise StoreError(ErrorCode.INVALID_PARAMS, "batch arguments must be lists") from None
    if len(n) != 1:
        raise StoreError(ErrorCode.INVALID_PARAMS, "batch argument lists differ in length")
    return n.pop()


class MemoryOps(ClientBase):
    """Registration, staging and local views of ``StoreClient``."""

    @staticmethod
    def _alloc_segment(size: int) -> tuple[Any, np.ndarray]:
        """Shared memory when the transfer layer offers it (same-host peers map it)."""
        try:
            from pymooncake.transfer.memory import SharedBuffer

            buf = SharedBuffer(size)
            return buf, np.frombuffer(buf.view(), dtype=np.uint8)
        except Exception:  # no /dev/shm: private memory, reached over tcp
            arr = np.zeros(size, dtype=np.uint8)
            return arr, arr

    def register_buffer(self, buffer: object) -> int:
        """Register a user buffer for ``put_from``/``get_into``; returns its base address.
        Raises ``StoreError(INVALID_PARAMS)`` for a non-contiguous or overlapping buffer."""
        from pymooncake.transfer.memory import buffer_address

        self._started_dp("register_buffer")
        try:
            _, nbytes, keep = buffer_address(buffer)
            addr = self._dp.register(buffer)
        except (ValueError, TypeError) as e:
            raise StoreError(ErrorCode.INVALID_PARAMS, f"cannot register buffer: {e}") from None
        self._registered[addr] = (nbytes, keep)
        return addr

    def register_memory(self, addr: int, size: int) -> int:
        """Register raw memory ``[addr, addr+size)`` that the caller keeps alive."""
        self._started_dp("register_memory")
        if not isinstance(addr, int) or not isinstance(size, int) or addr <= 0 or size <= 0:
            raise StoreError(ErrorCode.INVALID_PARAMS,
                             f"register_memory({addr!r}, {size!r}): need addr > 0, size > 0")
        try:
            self._dp.register_at(addr, size)
        except (ValueError, TypeError) as e:
            raise StoreError(ErrorCode.INVALID_PARAMS, f"cannot register memory: {e}") from None
        self._registered[addr] = (size, None)
        return addr

    def unregister_buffer(self, addr: int) -> None:
        if not _is_int(addr) or addr not in self._registered:
            raise StoreError(ErrorCode.INVALID_PARAMS, f"address {addr!r} is not registered")
        self._started_dp("unregister_buffer")
        self._dp.unregister(addr)
        del self._registered[addr]

    def _stage(self, size: int) -> tuple[int, np.ndarray, Callable[[], None]]:
        """A registered local range of ``size`` bytes: (addr, view, release)."""
        self._started_dp("_stage")
        if self._staging is not None:
            with self._lock:
                off = self._staging.allocate(size) if size <= self.local_buffer_size else None
            if off is not None:
                assert self._staging_arr is not None

                def release(off: int = off) -> None:
                    with self._lock:
                        assert self._staging is not None
                        self._staging.free(off)

                return (self._staging_base + off, self._staging_arr[off:off + size], release)
        # oversize or busy: the overflow buffer, registered once and kept at the largest
        # size asked (registering publishes the segment: milliseconds, not per operation)
        with self._lock:
            ov = self._overflow
            take = not self._overflow_busy and size <= OVERFLOW_MAX_BYTES
            if take:
                self._overflow_busy = True
        if not take:  # another thread holds it: a one-off buffer
            arr = np.empty(max(size, 1), dtype=np.uint8)
            addr = self._dp.register(arr)
            dp = self._dp
            return addr, arr[:size], lambda: dp.unregister(addr)
        try:
            if ov is None or ov[0].nbytes < size:
                if ov is not None:
                    self._overflow = None
                    self._dp.unregister(ov[1])
                arr = np.empty(max(size, 1), dtype=np.uint8)
                ov = self._overflow = (arr, self._dp.register(arr))
        except BaseException:
            self._overflow_busy = False
            raise

        def give_back() -> None:
            self._overflow_busy = False

        return ov[1], ov[0][:size], give_back

    def _check_range(self, addr: object, size: object, min_size: int) -> None:
        """``StoreError(INVALID_PARAMS)`` unless ``addr`` is an int address and ``size`` an
        int >= ``min_size`` whose range lies inside one registered buffer (bad arguments
        are refused, never a ``TypeError`` from deep inside: case BUG-28)."""
        if not _is_int(size) or size < min_size:  # type: ignore[operator]
            raise StoreError(ErrorCode.INVALID_PARAMS,
                             f"size={size!r}: must be an int >= {min_size}")
        if not _is_int(addr) or addr <= 0:  # type: ignore[operator]
            raise StoreError(ErrorCode.INVALID_PARAMS, f"addr={addr!r}: must be an int > 0")
        if not self._in_registered(addr, max(size, 1)):  # type: ignore[arg-type]
            raise StoreError(ErrorCode.INVALID_PARAMS,
                             f"[{addr:#x}, +{size}) is not inside a registered buffer")

    def _in_registered(self, addr: int, size: int) -> bool:
        return any(base <= addr and addr + size <= base + n
                   for base, (n, _) in self._registered.items())

    def _local_view(self, addr: int, length: int) -> np.ndarray | None:
        """A view of ``[addr, addr+length)`` when it lies in this client's own segment."""
        off = addr - self.segment_base
        if self._segment_arr is None or off < 0 or off + length > self.global_segment_size:
            return None
        return self._segment_arr[off:off + length]
