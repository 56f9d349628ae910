"""Small records of ``MasterCore``'s state and the key check every call makes.

``Effects`` is the work a core call leaves for the I/O shell (``service.py`` drains it);
``_Discarded`` and ``_Client`` are the core's (and the journal's) bookkeeping records.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from pymooncake.store.errors import ErrorCode, StoreError
from pymooncake.store.protocol import SpillOrder


@dataclass(slots=True)
class _Discarded:
    """Space of a taken-over or abandoned put, freed at ``release_ms``."""

    ranges: list[tuple[str, int]]
    release_ms: float


@dataclass(slots=True)
class Effects:
    """Work for the I/O shell produced by a call (drained by the service)."""

    spills: list[SpillOrder] = field(default_factory=list)
    ssd_deletes: list[tuple[str, str]] = field(default_factory=list)  # (segment, key)
    evicted: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # reason → n
    dropped_clients: list[str] = field(default_factory=list)
    stalled_passes: int = 0  # watermark passes over the watermark that found no candidate


@dataclass(slots=True)
class _Client:
    client_id: str
    last_seen_ms: float
    segments: set[str] = field(default_factory=set)


def validate_key(key: object, max_key_bytes: int) -> str:
    """The key, or ``StoreError(INVALID_KEY)`` for a non-str, empty or too long key."""
    if type(key) is str and 0 < len(key) <= max_key_bytes and key.isascii():
        return key  # ASCII: one byte a character (the hot path: no encode)
    if not isinstance(key, str):
        raise StoreError(ErrorCode.INVALID_KEY, f"key must be str, got {type(key).__name__}")
    if not key:
        raise StoreError(ErrorCode.INVALID_KEY, "empty key")
    n = len(key.encode("utf-8", "surrogatepass"))
    if n > max_key_bytes:
        raise StoreError(ErrorCode.INVALID_KEY, f"key of {n} bytes exceeds {max_key_bytes}")
    return key
