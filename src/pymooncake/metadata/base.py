"""Metadata service interface: keys → bytes with TTL leases and watches (DESIGN.md §2).

The Transfer Engine publishes segment descriptors here and the Store's masters elect a
leader here, as Mooncake does with its HTTP metadata server or etcd. Every backend
(`embedded`, `http`, `etcd`) implements :class:`MetadataStore` and passes the same
contract suite (tests/metadata/test_contract.py).
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import NewType, Protocol, runtime_checkable

LeaseId = NewType("LeaseId", int)


class MetadataError(Exception):
    """A metadata operation could not be carried out (backend unreachable, bad reply)."""


MAX_TXN_OPS = 128
"""Most puts + deletes one :meth:`MetadataStore.guarded_write` may carry (etcd's default
``--max-txn-ops``)."""


class LeaseNotFound(MetadataError):
    """The lease id is unknown or has expired; grant a new lease."""


class WatchCompacted(MetadataError):
    """A watch fell so far behind that the events it needs were dropped; re-read the keys."""


class EventKind(enum.Enum):
    """What happened to a watched key (etcd's two event types)."""

    PUT = "put"
    DELETE = "delete"


@dataclass(frozen=True, slots=True)
class KeyValue:
    """A stored key: ``value`` bytes, the lease it is attached to, and its revision."""

    key: str
    value: bytes
    mod_revision: int
    """Revision of the store at this key's last put (monotonic across the store)."""
    lease_id: LeaseId | None = None


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change seen by a watch; ``value`` is ``b''`` for a delete (and a lease expiry)."""

    kind: EventKind
    key: str
    value: bytes
    revision: int


class Watch(Protocol):
    """An async iterator of :class:`WatchEvent` that must be closed (``await w.close()``)."""

    def __aiter__(self) -> AsyncIterator[WatchEvent]: ...

    async def __anext__(self) -> WatchEvent: ...

    async def close(self) -> None: ...


@runtime_checkable
class MetadataStore(Protocol):
    """Async key-value metadata with TTL leases and prefix watches.

    Keys are ``str`` (slash-separated, e.g. ``pymooncake/segments/<name>``); values are
    ``bytes``. Methods may be awaited from any event loop and any thread; backends keep
    one client per event loop. Network backends raise :class:`MetadataError` when the
    server cannot be reached within their timeout.
    """

    url: str

    async def get(self, key: str) -> KeyValue | None:
        """The key's value, or ``None`` when absent (or its lease expired)."""
        ...

    async def get_prefix(self, prefix: str) -> list[KeyValue]:
        """All keys starting with ``prefix``, sorted by key."""
        ...

    async def put(self, key: str, value: bytes, *, lease_id: LeaseId | None = None) -> int:
        """Store ``value``; with ``lease_id`` the key is deleted when the lease expires.

        Returns the new revision. Raises :class:`LeaseNotFound` for an unknown lease.
        """
        ...

    async def create(self, key: str, value: bytes, *, lease_id: LeaseId | None = None) -> bool:
        """Put only if the key is absent (atomic); ``True`` when this call created it."""
        ...

    async def delete(self, key: str) -> bool:
        """Delete the key; ``True`` when it existed."""
        ...

    async def guarded_write(self, guard_key: str, guard_revision: int,
                            puts: Sequence[tuple[str, bytes]] = (),
                            deletes: Sequence[str] = ()) -> int | None:
        """Apply ``puts`` then ``deletes`` atomically, only while ``guard_key`` exists with
        ``mod_revision == guard_revision`` (an etcd transaction comparing the key's mod
        revision): the fence a leader puts on every write it makes.

        Returns the store's new revision, or ``None`` when the guard did not hold (nothing
        was written). Raises ``ValueError`` for more than :data:`MAX_TXN_OPS` operations
        or an empty key, and :class:`MetadataError` when the backend cannot be reached
        (the write may or may not have happened).
        """
        ...

    async def grant_lease(self, ttl_s: float) -> LeaseId:
        """A new lease that expires ``ttl_s`` seconds from now unless kept alive.

        etcd rounds ``ttl_s`` up to whole seconds.
        """
        ...

    async def keep_alive(self, lease_id: LeaseId) -> None:
        """Restart the lease's TTL; raises :class:`LeaseNotFound` when it has expired."""
        ...

    async def revoke_lease(self, lease_id: LeaseId) -> None:
        """End the lease now and delete its keys (no error when already gone)."""
        ...

    async def watch_prefix(self, prefix: str) -> Watch:
        """Events for keys starting with ``prefix`` from now on (puts, deletes, expiries)."""
        ...

    async def close(self) -> None:
        """Release clients and background tasks of this handle."""
        ...
