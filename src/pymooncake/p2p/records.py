"""This peer's holder records in the metadata service: one lease, coalesced puts.

Every record of a peer is put under one lease of ``ttl_s`` that is kept alive every
``ttl_s / 3`` on this module's own event-loop thread (metadata clients are per loop). If
the lease lapses while the peer lives (a stalled process, a restarted metadata server),
a new one is granted and every record whose payload still exists is put again.

A record is never written without a lease (it would never expire): every put happens on
the loop under ``_put_lock`` with the current lease, and :meth:`revoke` marks the records
revoked before anything else, then drops the lease under the same lock, so a put still
queued (``publish_soon``) or asked for later is dropped, never written lease-less.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from pymooncake.metadata import LeaseId, LeaseNotFound, MetadataError, MetadataStore
from pymooncake.obs.logging import init_logger
from pymooncake.p2p.manifest import holder_key, manifest_key

logger = init_logger(__name__)
T = TypeVar("T")


class HolderRecords:
    """Publishes ``value_of(name)`` under ``holder_key(name, segment)`` for the names
    ``names()`` returns; ``value_of`` returns ``None`` for a name no longer held."""

    def __init__(self, metadata: MetadataStore, segment: str, ttl_s: float,
                 value_of: Callable[[str], bytes | None],
                 names: Callable[[], list[str]]) -> None:
        self.metadata, self.segment, self.ttl_s = metadata, segment, ttl_s
        self.value_of, self.names = value_of, names
        self._lock = threading.Lock()
        self._dirty: set[str] = set()
        self._publishing: set[str] = set()
        self._lease: LeaseId | None = None
        self._revoked = False
        self._keepalive: asyncio.Task[None] | None = None
        self._loop = asyncio.new_event_loop()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=f"p2p-loop-{segment}")
        self._thread.start()
        self._put_lock = asyncio.Lock()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 15.0) -> T:
        """Run ``coro`` on the records' loop and wait (``TimeoutError`` after ``timeout_s``;
        ``RuntimeError`` once :meth:`close` stopped the loop)."""
        if self._stopped:
            coro.close()
            raise RuntimeError(f"p2p holder records of {self.segment} are closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def start(self) -> None:
        """Grant the lease and start keeping it alive (``MetadataError`` if unreachable)."""
        self._lease = self.run(self.metadata.grant_lease(self.ttl_s))
        self.run(self._spawn_keepalive())

    async def _spawn_keepalive(self) -> None:
        self._keepalive = asyncio.get_running_loop().create_task(self._keep_alive())

    async def _keep_alive(self) -> None:
        while not self._revoked:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                lease = self._lease
                if lease is None or self._revoked:
                    return
                await self.metadata.keep_alive(lease)
            except LeaseNotFound:       # expired while we were stalled: advertise again
                logger.warning("p2p: holder lease of %s lapsed; publishing again", self.segment)
                async with self._put_lock:
                    if self._revoked:
                        return
                    self._lease = await self.metadata.grant_lease(self.ttl_s)
                for name in self.names():
                    if await self.metadata.get(manifest_key(name)) is not None:
                        await self._put(name)
            except (MetadataError, OSError) as e:
                logger.warning("p2p: keep-alive of %s failed: %s", self.segment, e)

    async def _put(self, name: str) -> None:
        async with self._put_lock:       # the value is read here: the last put is the newest
            if self._revoked or self._lease is None:
                return                   # revoked (closing): never put a lease-less record
            value = self.value_of(name)
            if value is None:
                return
            key = holder_key(name, self.segment)
            try:
                await self.metadata.put(key, value, lease_id=self._lease)
            except LeaseNotFound:
                if self._revoked:
                    return
                self._lease = await self.metadata.grant_lease(self.ttl_s)
                await self.metadata.put(key, value, lease_id=self._lease)

    def publish(self, name: str) -> None:
        """Put ``name``'s record now and wait (``MetadataError``/``TimeoutError``)."""
        self.run(self._put(name))

    def publish_soon(self, name: str) -> None:
        """Put ``name``'s record without waiting: puts are coalesced and the last one carries
        the newest state (a pulling worker never waits for the metadata service). Dropped
        after :meth:`revoke`."""
        with self._lock:
            if self._revoked:
                return
            self._dirty.add(name)
            if name in self._publishing:
                return
            self._publishing.add(name)
        asyncio.run_coroutine_threadsafe(self._publisher(name), self._loop)

    async def _publisher(self, name: str) -> None:
        try:
            while True:
                with self._lock:
                    if name not in self._dirty:
                        self._publishing.discard(name)
                        return
                    self._dirty.discard(name)
                try:
                    await self._put(name)
                except (MetadataError, OSError) as e:
                    logger.warning("p2p: cannot advertise %s: %s", name, e)
        except BaseException:
            with self._lock:
                self._publishing.discard(name)
            raise

    async def _delete(self, name: str) -> None:
        async with self._put_lock:      # after any put in flight, never before it
            await self.metadata.delete(holder_key(name, self.segment))

    def withdraw(self, name: str) -> None:
        """Delete ``name``'s record (logged, not raised, when the service is unreachable).
        The caller makes ``value_of(name)`` return ``None`` first, so no later put brings
        the record back."""
        try:
            self.run(self._delete(name))
        except (MetadataError, TimeoutError) as e:
            logger.warning("p2p: cannot withdraw holder record of %s: %s", name, e)

    def revoke(self) -> None:
        """Stop the keep-alive and revoke the lease: every record of this peer goes, and no
        record is put any more (a publish still queued, or asked for later, is dropped)."""
        with self._lock:
            self._revoked = True        # first: no queued or later put may run from here on
        try:
            self.run(self._revoke(), timeout_s=5)
        except Exception as e:          # noqa: BLE001 - closing: the lease lapses anyway
            logger.warning("p2p: cannot revoke lease of %s: %s", self.segment, e)

    async def _revoke(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
            await asyncio.wait([self._keepalive])
        async with self._put_lock:      # after any put in flight, which used the lease
            lease, self._lease = self._lease, None
            if lease is not None:
                await self.metadata.revoke_lease(lease)

    def close(self) -> None:
        """Close this loop's metadata client, reap its leftover tasks, stop the loop."""
        self._stopped = True
        stop_loop(self._loop, self._thread, self.metadata)


def stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread,
              metadata: MetadataStore) -> None:
    """Close ``metadata``'s client of ``loop`` (etcd: a grpc channel), then cancel and reap
    every task left on the loop (grpc's call-status tasks among them) and stop it: no task
    is left to be "destroyed but pending" at exit.

    The loop is stopped, not closed. gRPC asyncio runs every completion on the first loop
    that used it and hands a call made on another loop its completion with
    ``loop.call_soon_threadsafe``; a completion grpc had already read (a cancelled stream's
    end, a closed channel's last status) can arrive after this loop stopped. On a closed
    loop that printed "Event loop is closed" on stderr at process exit (the p2p CLI's
    ``get`` in CI); on a stopped, open loop it queues a callback that never runs. grpc's
    pending call keeps the loop alive through its future, and when the last reference goes
    ``BaseEventLoop.__del__`` closes it (selector and self-pipe).
    """
    if loop.is_closed() or not thread.is_alive():
        return
    for coro in (metadata.close, _cancel_pending):
        try:
            asyncio.run_coroutine_threadsafe(coro(), loop).result(5)
        except Exception as e:          # noqa: BLE001 - closing: report, carry on
            logger.debug("p2p: closing the records loop: %r", e)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


async def _cancel_pending() -> None:
    """Cancel and reap every other task of the loop, so none is destroyed pending. A few
    rounds: a cancelled task may leave another behind (a grpc call and its status task)."""
    for _ in range(3):
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if not tasks:
            return
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
