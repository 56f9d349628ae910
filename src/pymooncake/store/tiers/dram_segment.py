"""DRAM segment: one contiguous buffer, carved by an offset allocator with size-class bins.

``OffsetAllocator`` is pure (no I/O): free ranges are kept in power-of-two bins (bin ``i``
holds free ranges of ``[2**i, 2**(i+1))`` bytes) plus offset/end maps for O(1) coalescing.
An allocation of ``n`` bytes first takes any range from the lowest non-empty bin whose
every member is ``>= n`` (one bit scan over a bitmask: O(1)); only when that fails does it
scan the one bin that may hold a fit. Freed ranges merge with free neighbours at once, so
the free space is always maximal ranges. ``fragmentation()`` = 1 - largest free range /
total free bytes (0 when free space is one range or none).

``DramSegment`` owns the buffer (numpy ``uint8``) that a storage process registers with
the Transfer Engine and mounts on the master (Mooncake paper §3.2: every node contributes
its DRAM to the pool).
"""

from __future__ import annotations

import numpy as np

DEFAULT_ALIGNMENT = 64
"""Allocations start on 64-byte boundaries (cache lines); sizes round up to it."""


class OffsetAllocator:
    """Allocate byte ranges ``[offset, offset + size)`` of a region of ``capacity_bytes``.

    ``allocate(size_bytes)`` → offset, or ``None`` when no free range is large enough
    (never partial). ``free(offset)`` returns a range; freeing an unknown offset raises
    ``KeyError``. Sizes are rounded up to ``alignment``.
    """

    def __init__(self, capacity_bytes: int, alignment: int = DEFAULT_ALIGNMENT) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes={capacity_bytes}: must be >= 0")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment={alignment}: must be a power of two")
        self.alignment = alignment
        self.capacity_bytes = capacity_bytes - capacity_bytes % alignment
        self._free_by_offset: dict[int, int] = {}
        self._free_by_end: dict[int, int] = {}
        self._bins: list[dict[int, None]] = [{} for _ in range(64)]
        self._mask = 0
        self._allocated: dict[int, int] = {}
        self.used_bytes = 0
        if self.capacity_bytes > 0:
            self._insert_free(0, self.capacity_bytes)

    # -- bins ------------------------------------------------------------------------

    def _insert_free(self, offset: int, size: int) -> None:
        b = size.bit_length() - 1
        self._free_by_offset[offset] = size
        self._free_by_end[offset + size] = offset
        self._bins[b][offset] = None
        self._mask |= 1 << b

    def _remove_free(self, offset: int) -> int:
        size = self._free_by_offset.pop(offset)
        del self._free_by_end[offset + size]
        self._unbin(offset, size)
        return size

    def _unbin(self, offset: int, size: int) -> None:
        """Take the free range ``[offset, offset + size)`` out of its bin (its maps are
        the caller's)."""
        b = size.bit_length() - 1
        bin_ = self._bins[b]
        del bin_[offset]
        if not bin_:
            self._mask &= ~(1 << b)

    def _round(self, size_bytes: int) -> int:
        a = self.alignment
        return (size_bytes + a - 1) // a * a

    # -- public ----------------------------------------------------------------------

    def allocate(self, size_bytes: int) -> int | None:
        """Offset of a new range of ``size_bytes`` (>0), or ``None`` when nothing fits."""
        if size_bytes <= 0:
            raise ValueError(f"size_bytes={size_bytes}: must be > 0")
        size = self._round(size_bytes)
        need_bin = (size - 1).bit_length()  # every range in bins >= need_bin is >= size
        candidates = self._mask >> need_bin << need_bin
        offset = None
        if candidates:
            b = (candidates & -candidates).bit_length() - 1
            offset = next(iter(self._bins[b]))
        elif need_bin >= 1 and self._mask & (1 << (need_bin - 1)):
            for off in self._bins[need_bin - 1]:
                if self._free_by_offset[off] >= size:
                    offset = off
                    break
        if offset is None:
            return None
        free_size = self._remove_free(offset)
        if free_size > size:
            self._insert_free(offset + size, free_size - size)
        self._allocated[offset] = size
        self.used_bytes += size
        return offset

    def free(self, offset: int) -> int:
        """Return the range at ``offset``; gives its (rounded) size in bytes. Raises
        ``KeyError`` for an offset not allocated. The range merges with a free neighbour
        on either side, each found and dropped from its map with one ``pop`` (this is
        every Store ``remove``'s allocator step on the master)."""
        size = self._allocated.pop(offset)
        self.used_bytes -= size
        start, end = offset, offset + size
        prev = self._free_by_end.pop(start, None)  # the free range ending here: merged
        if prev is not None:
            del self._free_by_offset[prev]
            self._unbin(prev, start - prev)
            start = prev
        nxt = self._free_by_offset.pop(end, None)  # the free range starting here: merged
        if nxt is not None:
            del self._free_by_end[end + nxt]
            self._unbin(end, nxt)
            end += nxt
        self._insert_free(start, end - start)
        return size

    def reserve(self, offset: int, size_bytes: int) -> bool:
        """Allocate exactly ``[offset, offset + size_bytes)`` (rounded up to the alignment)
        when that whole range is free; ``False`` (nothing changed) when any of it is in use,
        outside the region or ``offset`` is not aligned. Restores a known layout (a master
        loading its metadata after a fail-over)."""
        if size_bytes <= 0 or offset < 0 or offset % self.alignment:
            return False
        size = self._round(size_bytes)
        for start, free_size in self._free_by_offset.items():
            if start <= offset and offset + size <= start + free_size:
                break
        else:
            return False
        self._remove_free(start)
        if offset > start:
            self._insert_free(start, offset - start)
        if start + free_size > offset + size:
            self._insert_free(offset + size, start + free_size - offset - size)
        self._allocated[offset] = size
        self.used_bytes += size
        return True

    def size_of(self, offset: int) -> int:
        return self._allocated[offset]

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def largest_free_bytes(self) -> int:
        if not self._mask:
            return 0
        top = self._mask.bit_length() - 1
        return max(self._free_by_offset[o] for o in self._bins[top])

    def fragmentation(self) -> float:
        """1 - largest free range / free bytes, in [0, 1); 0 when nothing or one range is free."""
        free = self.free_bytes
        if free <= 0:
            return 0.0
        return 1.0 - self.largest_free_bytes() / free

    def num_allocations(self) -> int:
        return len(self._allocated)


class DramSegment:
    """A storage process's contribution to the pool: ``size_bytes`` of zeroed DRAM.

    ``buffer`` is a numpy ``uint8`` array; register it with the Transfer Engine and mount
    (name, base address, size) on the master. The master allocates inside it; this process
    never writes to it itself except to load SSD-resident objects back (``write_at``).
    """

    def __init__(self, size_bytes: int) -> None:
        if size_bytes <= 0:
            raise ValueError(f"size_bytes={size_bytes}: a segment needs > 0 bytes")
        self.size_bytes = size_bytes
        self.buffer = np.zeros(size_bytes, dtype=np.uint8)

    def view(self, offset: int, length: int) -> memoryview:
        """``length`` bytes at ``offset`` (bounds-checked; raises ``ValueError``)."""
        if offset < 0 or length < 0 or offset + length > self.size_bytes:
            raise ValueError(f"range [{offset}, {offset + length}) outside segment of "
                             f"{self.size_bytes} bytes")
        return memoryview(self.buffer)[offset:offset + length]

    def read_at(self, offset: int, length: int) -> bytes:
        return self.view(offset, length).tobytes()

    def write_at(self, offset: int, data: bytes | memoryview) -> None:
        self.view(offset, len(data))[:] = data
