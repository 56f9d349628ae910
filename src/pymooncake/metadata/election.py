"""Leader election over metadata leases (Mooncake Store HA masters elect through etcd).

A candidate grants a lease of ``ttl_s``, then atomically creates ``key`` = its id on that
lease. The winner keeps the lease alive every ``ttl_s / 3``; when it resigns (or dies and
the lease expires) the key is deleted and waiting candidates race again. Works on every
:class:`~pymooncake.metadata.base.MetadataStore` backend.

Fencing: ``revision`` is the leader key's mod revision once won; a leader passes it to
:meth:`~pymooncake.metadata.base.MetadataStore.guarded_write` so none of its writes lands
after the key is gone or owned by a successor. ``valid()`` is the leader's own view of its
lease: true until ``ttl_s`` after the *sending* of its last successful keep-alive (less a
margin), which is never later than the moment the metadata service expires the lease. A
leader that was frozen (SIGSTOP) or cut off therefore sees itself invalid before anybody
else can have won.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from pymooncake.metadata.aio import cancel_and_wait, next_within
from pymooncake.metadata.base import (
    EventKind,
    LeaseId,
    LeaseNotFound,
    MetadataError,
    MetadataStore,
    Watch,
)
from pymooncake.obs.logging import init_logger

logger = init_logger(__name__)


def lease_clock() -> float:
    """Seconds on the clock a leader measures its lease with: ``CLOCK_BOOTTIME`` where
    there is one (it keeps counting while the host is suspended, as the metadata service's
    clock does), else ``time.monotonic``."""
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    return time.clock_gettime(boottime) if boottime is not None else time.monotonic()


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
        self.revision: int | None = None
        """Mod revision of ``key`` written by this candidate's win (the fencing token)."""
        self._valid_until = float("-inf")
        self._keepalive: asyncio.Task[None] | None = None
        self._lost = asyncio.Event()

    @property
    def is_leader(self) -> bool:
        return self._lease is not None and not self._lost.is_set()

    VALIDITY_MARGIN_S = 0.2
    """Seconds of its lease a leader gives up, against clock-rate differences."""

    def valid(self, now_s: float | None = None) -> bool:
        """Leader, and the lease cannot have expired yet at ``now_s`` (``lease_clock()``
        seconds; see the module docstring)."""
        now = lease_clock() if now_s is None else now_s
        return self.is_leader and now < self._valid_until - self.VALIDITY_MARGIN_S

    async def leader(self) -> bytes | None:
        """The current leader's id, or ``None`` when there is none."""
        kv = await self.metadata.get(self.key)
        return kv.value if kv is not None else None

    async def campaign(self, timeout_s: float | None = None) -> bool:
        """Become leader; ``False`` if ``timeout_s`` passes first. Waits on a watch of
        ``key`` (woken by deletes and expiries) with a ``ttl_s`` poll as a fallback: a
        watch that cannot be opened or breaks is only a slower wake-up, never a reason to
        stop campaigning or to retry without a pause. Raises ``MetadataError`` when the
        metadata service cannot be reached (callers campaign again)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        watch = None
        try:
            while True:
                if watch is None:
                    try:
                        watch = await self.metadata.watch_prefix(self.key)
                    except MetadataError as e:
                        logger.info("watch of %s unavailable (%s): polling it", self.key, e)
                if await self._try_win():
                    return True
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                wait_s = self.ttl_s if remaining is None else min(self.ttl_s, remaining)
                if watch is None or not await self._wait_delete(watch, wait_s):
                    if watch is not None:
                        with contextlib.suppress(Exception):
                            await watch.close()
                        watch = None
                    await asyncio.sleep(wait_s)
        finally:
            if watch is not None:
                with contextlib.suppress(Exception):
                    await watch.close()

    async def _try_win(self) -> bool:
        sent = lease_clock()
        lease = await self.metadata.grant_lease(self.ttl_s)
        try:
            created = await self.metadata.create(self.key, self.candidate_id, lease_id=lease)
        except BaseException:
            with contextlib.suppress(Exception):
                await self.metadata.revoke_lease(lease)
            raise
        if created:
            kv = await self.metadata.get(self.key)
            if kv is None or kv.value != self.candidate_id:
                return False  # expired at once (frozen in between): campaign again
            self.revision = kv.mod_revision
            self._valid_until = sent + self.ttl_s
            self._lease = lease
            self._lost = asyncio.Event()
            self._keepalive = asyncio.create_task(self._keep_alive(lease))
            return True
        await self.metadata.revoke_lease(lease)
        return False

    async def _wait_delete(self, watch: Watch, wait_s: float) -> bool:
        """Wait up to ``wait_s`` for ``key`` to be deleted; False when the watch broke."""
        loop = asyncio.get_running_loop()
        until = loop.time() + wait_s
        try:  # (not wait_for: on 3.11 it can drop a cancellation that comes with an event)
            while (left := until - loop.time()) > 0:
                ev = await next_within(watch, left)
                if ev is None or (ev.key == self.key and ev.kind is EventKind.DELETE):
                    return True
        except (StopAsyncIteration, MetadataError) as e:
            logger.info("watch of %s ended (%r): polling it", self.key, e)
            return False
        return True

    async def _keep_alive(self, lease: LeaseId) -> None:
        try:
            while True:
                await asyncio.sleep(self.ttl_s / 3)
                sent = lease_clock()
                await self.metadata.keep_alive(lease)
                self._valid_until = sent + self.ttl_s
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
        if self._keepalive is not None:  # (bounded; our own cancellation goes through)
            await cancel_and_wait(self._keepalive, f"keep-alive of {self.key}")
            self._keepalive = None
        if self._lease is not None:
            lease, self._lease = self._lease, None  # not leader any more, even if the
            self._valid_until = float("-inf")      # revoke fails (the lease then expires)
            await self.metadata.revoke_lease(lease)

    async def abandon(self) -> None:
        """Stop keeping the lease alive without revoking it (what a crash looks like)."""
        if self._keepalive is not None:  # (bounded; our own cancellation goes through)
            await cancel_and_wait(self._keepalive, f"keep-alive of {self.key}")
            self._keepalive = None
        self._lease = None
        self._valid_until = float("-inf")
