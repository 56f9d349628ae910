"""Read leases and pins against an injected clock (pure; times in milliseconds).

Mooncake semantics (../shared/MOONCAKE.md "Leases"): ``get_replica_list`` and ``exist``
grant a read lease of ``default_kv_lease_ttl``; ``put_end`` grants none (a fresh object is
removable and evictable at once). A leased object is neither evicted nor removed (unless
forced). Leases are counted per holder (the client that read): ``count(key)`` is the number
of holders with an unexpired lease and ``release(key, holder)`` drops one holder's lease,
so acquiring and releasing are symmetric (case BUG-21: the matched block and all its
ancestors are locked and unlocked together when the holder leases the whole prefix chain).

Pins: a soft pin holds until a fixed deadline set when the object becomes readable (reads
do not extend it); a hard pin never lapses.
"""

from __future__ import annotations

from dataclasses import dataclass


class LeaseTable:
    """Per-key read leases: ``key → {holder: deadline_ms}``."""

    def __init__(self) -> None:
        self._leases: dict[str, dict[str, float]] = {}

    def grant(self, key: str, holder: str, now_ms: float, ttl_ms: float) -> float:
        """Lease ``key`` to ``holder`` until ``now_ms + ttl_ms`` (extends, never shortens)."""
        if ttl_ms <= 0:
            return now_ms
        holders = self._leases.setdefault(key, {})
        deadline = max(holders.get(holder, 0.0), now_ms + ttl_ms)
        holders[holder] = deadline
        return deadline

    def release(self, key: str, holder: str) -> bool:
        """Drop ``holder``'s lease on ``key``; True when it held one."""
        holders = self._leases.get(key)
        if not holders or holder not in holders:
            return False
        del holders[holder]
        if not holders:
            del self._leases[key]
        return True

    def count(self, key: str, now_ms: float) -> int:
        """Holders whose lease on ``key`` is still valid at ``now_ms``."""
        holders = self._leases.get(key)
        if not holders:
            return 0
        return sum(1 for d in holders.values() if d > now_ms)

    def is_leased(self, key: str, now_ms: float) -> bool:
        holders = self._leases.get(key)
        return bool(holders) and any(d > now_ms for d in holders.values())

    def deadline(self, key: str) -> float:
        holders = self._leases.get(key)
        return max(holders.values()) if holders else 0.0

    def drop(self, key: str) -> None:
        self._leases.pop(key, None)

    def expire(self, now_ms: float) -> None:
        """Forget every lapsed lease (bounded memory)."""
        for key in list(self._leases):
            holders = self._leases[key]
            for h in [h for h, d in holders.items() if d <= now_ms]:
                del holders[h]
            if not holders:
                del self._leases[key]

    def num_leased(self, now_ms: float) -> int:
        return sum(1 for k in self._leases if self.is_leased(k, now_ms))


@dataclass(slots=True)
class Pin:
    """An object's pins: ``hard`` never lapses; ``soft_deadline_ms`` is fixed at publish."""

    hard: bool = False
    soft_deadline_ms: float | None = None

    def soft_pinned(self, now_ms: float) -> bool:
        return self.soft_deadline_ms is not None and now_ms < self.soft_deadline_ms


def soft_pin_deadline(publish_ms: float, ttl_ms: float) -> float:
    """Deadline of a soft pin taken when the object becomes readable at ``publish_ms``."""
    return publish_ms + ttl_ms
