"""Pure key-value state with revisions, TTL leases and an event log (the clock is passed in).

Shared by the embedded backend and the HTTP metadata server so both behave identically.
Semantics follow etcd v3: every put/delete bumps a store-wide revision; a lease owns keys
and deletes them when it expires; watchers read the event log from a revision on.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import SplitResult, urlsplit

from pymooncake.metadata.base import (
    MAX_TXN_OPS,
    EventKind,
    KeyValue,
    LeaseId,
    LeaseNotFound,
    WatchCompacted,
    WatchEvent,
)


def check_txn(puts: Sequence[tuple[str, bytes]], deletes: Sequence[str]) -> None:
    """``ValueError`` for a guarded write with too many operations or an empty key."""
    if len(puts) + len(deletes) > MAX_TXN_OPS:
        raise ValueError(f"a guarded write carries at most {MAX_TXN_OPS} operations, got "
                         f"{len(puts) + len(deletes)}")
    if any(not k for k, _ in puts) or any(not k for k in deletes):
        raise ValueError("keys must be non-empty strings")


@dataclass(slots=True)
class _Lease:
    ttl_s: float
    deadline_s: float
    keys: set[str] = field(default_factory=set)


class KvState:
    """Keys, leases and the last ``history_len`` events; not thread-safe (callers lock).

    Every method takes ``now_s`` (monotonic seconds) and first expires due leases, so the
    state is correct whenever it is looked at, with or without a background reaper.
    """

    def __init__(self, history_len: int = 100_000) -> None:
        if history_len <= 0:
            raise ValueError(f"history_len must be > 0, got {history_len}")
        self.revision = 0
        self._kv: dict[str, KeyValue] = {}
        self._sorted_keys: list[str] = []
        self._leases: dict[int, _Lease] = {}
        self._next_lease_id = 1
        self._events: deque[WatchEvent] = deque(maxlen=history_len)

    # -- reads ---------------------------------------------------------------------------
    def get(self, key: str, now_s: float) -> KeyValue | None:
        self.expire(now_s)
        return self._kv.get(key)

    def get_prefix(self, prefix: str, now_s: float) -> list[KeyValue]:
        self.expire(now_s)
        i = bisect.bisect_left(self._sorted_keys, prefix)
        out: list[KeyValue] = []
        while i < len(self._sorted_keys) and self._sorted_keys[i].startswith(prefix):
            out.append(self._kv[self._sorted_keys[i]])
            i += 1
        return out

    def events_since(self, revision: int, prefix: str) -> list[WatchEvent]:
        """Events with revision > ``revision`` for keys under ``prefix``.

        Raises :class:`WatchCompacted` when events after ``revision`` were already dropped.
        """
        if self._events and self._events[0].revision > revision + 1:
            raise WatchCompacted(
                f"events after revision {revision} were compacted (oldest kept is "
                f"{self._events[0].revision}); re-read the keys and watch again")
        return [e for e in self._events if e.revision > revision and e.key.startswith(prefix)]

    # -- writes --------------------------------------------------------------------------
    def put(self, key: str, value: bytes, now_s: float, lease_id: int | None = None) -> int:
        self.expire(now_s)
        if not key:
            raise ValueError("key must be a non-empty string")
        if lease_id is not None and lease_id not in self._leases:
            raise LeaseNotFound(f"lease {lease_id} is unknown or expired; grant a new one")
        old = self._kv.get(key)
        if old is None:
            bisect.insort(self._sorted_keys, key)
        elif old.lease_id is not None and old.lease_id in self._leases:
            self._leases[old.lease_id].keys.discard(key)
        self.revision += 1
        lid = LeaseId(lease_id) if lease_id is not None else None
        self._kv[key] = KeyValue(key, bytes(value), self.revision, lid)
        if lid is not None:
            self._leases[lid].keys.add(key)
        self._events.append(WatchEvent(EventKind.PUT, key, bytes(value), self.revision))
        return self.revision

    def create(self, key: str, value: bytes, now_s: float, lease_id: int | None = None) -> bool:
        self.expire(now_s)
        if key in self._kv:
            return False
        self.put(key, value, now_s, lease_id)
        return True

    def guarded_write(self, guard_key: str, guard_revision: int,
                      puts: Sequence[tuple[str, bytes]], deletes: Sequence[str],
                      now_s: float) -> int | None:
        """Puts then deletes, all or nothing, iff ``guard_key``'s mod revision is
        ``guard_revision``; the new revision or ``None`` (see ``MetadataStore``)."""
        check_txn(puts, deletes)
        self.expire(now_s)
        kv = self._kv.get(guard_key)
        if kv is None or kv.mod_revision != guard_revision:
            return None
        for key, value in puts:
            self.put(key, value, now_s)
        for key in deletes:
            self._delete(key)
        return self.revision

    def delete(self, key: str, now_s: float) -> bool:
        self.expire(now_s)
        return self._delete(key)

    def _delete(self, key: str) -> bool:
        old = self._kv.pop(key, None)
        if old is None:
            return False
        i = bisect.bisect_left(self._sorted_keys, key)
        del self._sorted_keys[i]
        if old.lease_id is not None and old.lease_id in self._leases:
            self._leases[old.lease_id].keys.discard(key)
        self.revision += 1
        self._events.append(WatchEvent(EventKind.DELETE, key, b"", self.revision))
        return True

    # -- leases --------------------------------------------------------------------------
    def grant_lease(self, ttl_s: float, now_s: float) -> LeaseId:
        self.expire(now_s)
        if not (ttl_s > 0 and math.isfinite(ttl_s)):
            raise ValueError(f"ttl_s must be a positive number of seconds, got {ttl_s}")
        lid = self._next_lease_id
        self._next_lease_id += 1
        self._leases[lid] = _Lease(ttl_s, now_s + ttl_s)
        return LeaseId(lid)

    def keep_alive(self, lease_id: int, now_s: float) -> None:
        self.expire(now_s)
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseNotFound(f"lease {lease_id} is unknown or expired; grant a new one")
        lease.deadline_s = now_s + lease.ttl_s

    def revoke_lease(self, lease_id: int, now_s: float) -> None:
        self.expire(now_s)
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            for key in sorted(lease.keys):
                self._delete(key)

    def expire(self, now_s: float) -> list[WatchEvent]:
        """Expire every lease whose deadline is ≤ ``now_s``; the delete events it caused."""
        due = [lid for lid, lease in self._leases.items() if lease.deadline_s <= now_s]
        if not due:
            return []
        before = self.revision
        for lid in due:
            lease = self._leases.pop(lid)
            for key in sorted(lease.keys):
                self._delete(key)
        return [e for e in self._events if e.revision > before]

    def next_deadline_s(self) -> float | None:
        """The earliest lease deadline, for a reaper's sleep; ``None`` without leases."""
        return min((lease.deadline_s for lease in self._leases.values()), default=None)


def split_backend_url(url: str, scheme: str, example: str, head: str | None = None
                      ) -> tuple[SplitResult, int | None]:
    """``urlsplit`` of a metadata backend's ``url`` (of ``head``, its first part, when
    given) and its port (None when absent). Raises ``ValueError`` naming ``url`` and the
    expected form ``example`` for a port that is not a number in 0..65535, another scheme
    than ``scheme``, or no host."""
    parts = urlsplit(url if head is None else head)
    try:
        port = parts.port
    except ValueError as e:
        raise ValueError(f"{scheme} metadata url {url!r} has a bad port ({e}); it must look "
                         f"like {example} with a numeric port") from None
    if parts.scheme != scheme or not parts.hostname:
        raise ValueError(f"{scheme} metadata url must look like {example}, got {url!r}")
    return parts, port
