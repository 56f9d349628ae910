"""Cutting requests into slices: pure, no I/O (DESIGN.md §4, Mooncake §3.2.3).

A request of ``length`` bytes is cut into slices of ``slice_bytes`` each (the last one
shorter), where ``slice_bytes`` spreads the request over ``num_paths`` paths but stays
within ``[min_slice_bytes, max_slice_bytes]``::

    length = 2.5 MiB, num_paths = 2, max = 1 MiB
    |--- 1 MiB ---|--- 1 MiB ---|- 0.5 MiB -|
"""

from __future__ import annotations


def slice_size(length: int, num_paths: int, min_slice_bytes: int, max_slice_bytes: int) -> int:
    """Bytes per slice for a request of ``length`` bytes (>= 1)."""
    per_path = -(-length // max(1, num_paths))
    return max(min_slice_bytes, min(max_slice_bytes, per_path))


def split(length: int, size: int) -> list[tuple[int, int]]:
    """``[(offset, length), ...]`` covering ``[0, length)`` in pieces of ``size`` bytes."""
    if size <= 0:
        raise ValueError(f"slice size must be > 0, got {size}")
    return [(off, min(size, length - off)) for off in range(0, length, size)]
