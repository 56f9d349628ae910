"""Leader election over metadata leases (Mooncake Store HA masters elect through etcd).

A candidate grants a lease of ``ttl_s``, then atomically creates ``key`` = its id on that
lease. The winner keeps the lease alive every ``ttl_s / 3``; when it resigns (or dies and
the lease expires) the key is deleted and waiting candidates race again. Works on every
:class:`~pymooncake.metadata.base.MetadataStore` backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from pymooncake.metadata.base import EventKind, LeaseId, LeaseNotFound, MetadataStore
from pymooncake.obs.logging import init_logger

logger = init_logger(__name__)


class LeaderElection:
    """One candidate for the leadership recorded at ``key``."""

    def __init__(self, metadata: MetadataStore, key: str, candidate_id: bytes,
                 ttl_s: float = 2.0) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 seconds, got {ttl_s}")
        self.metadata = metadata
        self.key = key
        self.candidate_id = bytes(candidate_id)
        self.ttl_s = ttl_s
        self._lease: LeaseId | None = None
        self._keepalive: asyncio.Task[None] | None = None
        self._lost = asyncio.Event()

    @property
    def is_leader(self) -> bool:
        return self._lease is not None and not self._lost.is_set()

    async def leader(self) -> bytes | None:
        """The current leader's id, or ``None`` when there is none."""
        kv = await self.metadata.get(self.key)
        return kv.value if kv is not None else None

    async def campaign(self, timeout_s: float | None = None) -> bool:
        """Become leader; ``False`` if ``timeout_s`` passes first. Waits on a watch of
        ``key`` (woken by deletes and expiries) with a ``ttl_s`` poll as a fallback."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        watch = await self.metadata.watch_prefix(self.key)
        try:
            while True:
                lease = await self.metadata.grant_lease(self.ttl_s)
                if await self.metadata.create(self.key, self.candidate_id, lease_id=lease):
                    self._lease = lease
                    self._lost = asyncio.Event()
                    self._keepalive = asyncio.create_task(self._keep_alive(lease))
                    return True
                await self.metadata.revoke_lease(lease)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                wait_s = self.ttl_s if remaining is None else min(self.ttl_s, remaining)
                with contextlib.suppress(TimeoutError, StopAsyncIteration):
                    while True:
                        ev = await asyncio.wait_for(watch.__anext__(), timeout=wait_s)
                        if ev.key == self.key and ev.kind is EventKind.DELETE:
                            break
        finally:
            await watch.close()

    async def _keep_alive(self, lease: LeaseId) -> None:
        try:
            while True:
                await asyncio.sleep(self.ttl_s / 3)
                await self.metadata.keep_alive(lease)
        except LeaseNotFound:
            logger.warning("leadership of %s lost: lease expired", self.key)
            self._lost.set()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - metadata unreachable: leadership is unsafe
            logger.warning("leadership of %s lost: %r", self.key, e)
            self._lost.set()

    async def wait_lost(self) -> None:
        """Return when this leader's lease was lost (not on resign)."""
        await self._lost.wait()

    async def resign(self) -> None:
        """Give up leadership now (deletes ``key``); no-op when not leader."""
        if self._keepalive is not None:
            self._keepalive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keepalive
            self._keepalive = None
        if self._lease is not None:
            await self.metadata.revoke_lease(self._lease)
            self._lease = None

    async def abandon(self) -> None:
        """Stop keeping the lease alive without revoking it (what a crash looks like)."""
        if self._keepalive is not None:
            self._keepalive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keepalive
            self._keepalive = None
        self._lease = None
