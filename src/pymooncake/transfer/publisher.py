"""Segment publication and peer lookup on the metadata service (DESIGN.md §4).

The engine's segment descriptor is created put-if-absent under a lease of
``config.segment_ttl_s`` that is kept alive, so one segment name has one live owner
(``SegmentNameTaken`` otherwise); it is re-published on every registration change and
re-claimed when the lease is lost (metadata restart). Peer descriptors are cached and kept
current by a watch on the segment prefix. All metadata I/O runs on one small event-loop
thread; :meth:`SegmentPublisher.run` calls into it from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from pymooncake.metadata import (
    EventKind,
    LeaseId,
    LeaseNotFound,
    MetadataStore,
    WatchEvent,
)
from pymooncake.obs.logging import init_logger
from pymooncake.transfer.batch import SegmentNameTaken
from pymooncake.transfer.config import TransferConfig
from pymooncake.transfer.segment import SEGMENT_KEY_PREFIX, SegmentDescriptor, segment_key

logger = init_logger(__name__)
T = TypeVar("T")


class SegmentPublisher:
    """Publishes ``descriptor(version)`` as segment ``name``; caches peers' descriptors.

    ``on_peer_moved(name, host, port)`` is called when a cached peer republishes (it may
    have restarted on another port).
    """

    def __init__(self, name: str, metadata: MetadataStore, config: TransferConfig,
                 descriptor: Callable[[int], SegmentDescriptor],
                 on_peer_moved: Callable[[str, str, int], None]) -> None:
        self.name = name
        self.metadata = metadata
        self.config = config
        self._descriptor = descriptor
        self._on_peer_moved = on_peer_moved
        self.peers: dict[str, SegmentDescriptor] = {}
        self.segment_metadata: Callable[[str], MetadataStore] | None = None
        self.version = 0
        self._lease: LeaseId | None = None
        self._lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._tasks: list[Any] = []
        self._closed = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the loop thread and claim the name (raises what :meth:`claim` raises)."""
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run_loop() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()

        self._loop = loop
        self._thread = threading.Thread(target=run_loop, daemon=True,
                                        name=f"transfer-loop-{self.name}")
        self._thread.start()
        ready.wait(5)
        self.run(self._claim())
        self._tasks = [asyncio.run_coroutine_threadsafe(c, loop)
                       for c in (self._watch_segments(), self._keep_alive())]

    def close(self) -> None:
        """Withdraw the descriptor (revoke the lease), close the metadata client, stop."""
        self._closed = True
        for fut in self._tasks:
            fut.cancel()
        if self._loop is None:
            return
        with contextlib.suppress(Exception):
            self.run(self._withdraw())
        with contextlib.suppress(Exception):
            self.run(self.metadata.close())
        with contextlib.suppress(Exception):  # the watch, grpc's call-status tasks, ...
            self.run(_reap_tasks())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._stopped = True
        if self._thread is not None:
            self._thread.join(timeout=5)
        # Stopped, not closed: a grpc (etcd) completion of this loop's calls that grpc had
        # already read may still be handed to it with call_soon_threadsafe, which raises
        # "Event loop is closed" on a closed loop (p2p/records.py ``stop_loop``); the last
        # reference to the loop closes it (BaseEventLoop.__del__).

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop thread and wait for it (``metadata_timeout_s``)."""
        assert self._loop is not None, "engine not started"
        if self._stopped:
            coro.close()
            raise RuntimeError(f"transfer engine {self.name!r} is closed")
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result(timeout=self.config.metadata_timeout_s)

    # ------------------------------------------------------------------ our segment
    def publish(self) -> None:
        """Re-publish the descriptor (after a registration change)."""
        if self._loop is not None and not self._closed:
            self.run(self._publish())

    async def _claim(self) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            await self._claim_locked()

    async def _claim_locked(self) -> None:
        """Create the descriptor put-if-absent under a fresh lease; raises
        :class:`SegmentNameTaken` naming the current owner when the key exists."""
        md, key = self.metadata, segment_key(self.name)
        lease = await md.grant_lease(self.config.segment_ttl_s)
        owner = "another engine"
        try:
            for _ in range(3):  # the owner may withdraw between create and get
                self.version += 1
                if await md.create(key, self._descriptor(self.version).encode(),
                                   lease_id=lease):
                    self._lease = lease
                    return
                kv = await md.get(key)
                if kv is not None:
                    owner = _describe_owner(kv.value)
                    break
        except BaseException:
            with contextlib.suppress(Exception):
                await md.revoke_lease(lease)
            raise
        with contextlib.suppress(Exception):
            await md.revoke_lease(lease)
        raise SegmentNameTaken(self.name, owner, md.url)

    async def _publish(self) -> None:
        assert self._lock is not None
        async with self._lock:
            if self._lease is None:  # lost (metadata restart, expiry): claim again
                await self._claim_locked()
                return
            self.version += 1
            try:
                await self.metadata.put(segment_key(self.name),
                                        self._descriptor(self.version).encode(),
                                        lease_id=self._lease)
            except LeaseNotFound:
                self._lease = None
                await self._claim_locked()

    async def _withdraw(self) -> None:
        """Revoke the lease, which deletes the descriptor (only ours: never another's)."""
        async with self._lock or contextlib.nullcontext():
            lease, self._lease = self._lease, None
            if lease is not None:
                await self.metadata.revoke_lease(lease)

    async def _keep_alive(self) -> None:
        """Keep the descriptor's lease alive; re-claim the name if the lease was lost."""
        interval_s = self.config.segment_ttl_s / 3
        while not self._closed:
            await asyncio.sleep(interval_s)
            assert self._lock is not None
            try:
                async with self._lock:
                    if self._closed:
                        return
                    if self._lease is not None:
                        try:
                            await self.metadata.keep_alive(self._lease)
                            continue
                        except LeaseNotFound:
                            logger.warning("segment %r: lease lost (metadata restarted or "
                                           "keep-alive late); publishing again", self.name)
                            self._lease = None
                    await self._claim_locked()
            except asyncio.CancelledError:
                raise
            except SegmentNameTaken as e:
                logger.error("segment %r could not be published again: %s", self.name, e)
            except Exception as e:  # noqa: BLE001 - metadata down: retry next interval
                logger.info("segment %r: keep-alive failed: %r; retrying", self.name, e)

    # ------------------------------------------------------------------ peers
    def resolve(self, segment: str, refresh: bool = False) -> SegmentDescriptor | None:
        """A peer's descriptor (cached unless ``refresh``); ``None`` when unpublished."""
        if not refresh:
            desc = self.peers.get(segment)
            if desc is not None:
                return desc
        md = self.metadata if self.segment_metadata is None else self.segment_metadata(segment)
        kv = self.run(md.get(segment_key(segment)))
        if kv is None:
            self.peers.pop(segment, None)
            return None
        desc = SegmentDescriptor.decode(kv.value)
        self.peers[segment] = desc
        return desc

    async def _watch_segments(self) -> None:
        """Keep cached peer descriptors current: drop withdrawn ones, follow new ports."""
        while not self._closed:
            try:
                watch = await self.metadata.watch_prefix(SEGMENT_KEY_PREFIX)
            except Exception as e:  # noqa: BLE001 - metadata down: retry later
                logger.info("segment watch could not start: %r; retrying", e)
                await asyncio.sleep(1.0)
                continue
            try:
                async for ev in watch:
                    self._on_segment_event(ev)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a broken watch is restarted
                logger.info("segment watch ended: %r; restarting", e)
                await asyncio.sleep(0.5)
            finally:
                with contextlib.suppress(Exception):
                    await watch.close()

    def _on_segment_event(self, ev: WatchEvent) -> None:
        name = ev.key[len(SEGMENT_KEY_PREFIX):]
        if name == self.name:
            return
        if ev.kind is EventKind.DELETE:
            self.peers.pop(name, None)
            return
        if name not in self.peers:
            return  # not a peer of ours: resolved on first use
        try:
            desc = SegmentDescriptor.decode(ev.value)
        except ValueError:
            return
        self.peers[name] = desc
        self._on_peer_moved(name, desc.host, desc.tcp_port)


def _describe_owner(value: bytes) -> str:
    try:
        d = SegmentDescriptor.decode(value)
    except ValueError:
        return "an engine with an unreadable descriptor"
    return f"pid {d.pid} on {d.host} (tcp port {d.tcp_port}, host id {d.host_id})"


async def _reap_tasks() -> None:
    """Cancel and await every other task of the running loop, so that none is left to be
    "destroyed but it is pending" when the loop closes (a cancelled task may leave another
    behind, e.g. a grpc call its status task: a few rounds)."""
    for _ in range(3):
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if not tasks:
            return
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
