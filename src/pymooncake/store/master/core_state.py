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


_STR_ONLY = {str}


def keys_fast_ok(keys: object, max_key_bytes: int, no_nul: bool = False) -> bool:
    """True when every key of the sequence ``keys`` passes ``validate_key``'s fast path
    (exactly ``str``, ASCII, 1 to ``max_key_bytes`` characters) — and, with ``no_nul``,
    holds no NUL — checked in a few C-level passes over all of them (the batch calls' hot
    path). False means "check them one by one", not that one is bad; so does no key."""
    if not keys or {*map(type, keys)} != _STR_ONLY:  # type: ignore[call-overload]
        return False
    joined = "".join(keys)  # type: ignore[arg-type]
    return (joined.isascii() and "" not in keys  # type: ignore[operator]
            # all keys together within the limit: so is each (no per-key pass)
            and (len(joined) <= max_key_bytes
                 or max(map(len, keys)) <= max_key_bytes)  # type: ignore[call-overload]
            and not (no_nul and "\x00" in joined))


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
