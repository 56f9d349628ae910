"""The master process: ``MasterCore`` behind the RPC layer, with a clock and background work.

Every RPC handler is a thin shell: it takes the typed request (``store.protocol``, checked
field by field by the RPC layer as it is decoded), calls the pure core with ``now_ms`` from
the service clock, and maps ``StoreError`` to an ``RpcError`` whose ``code`` is the
``ErrorCode`` name and whose ``data`` is ``{"code": int}``. Batch
methods answer a list with one ``{"r": result}`` or ``{"e": [code, message]}`` per key.

Background work (every ``tick_interval_s``): drop silent clients, reclaim abandoned writes,
expire leases, evict at the high watermark, and carry out the core's SSD orders by RPC to
the storage process that owns the segment (``ssd_spill`` / ``ssd_load`` / ``ssd_delete``).
A put that finds no room while spills are in flight waits for them once and retries; a get
of an object held only on SSD loads it back into its owner's DRAM first (promotion).

The object-table gauges (objects, bytes per tier and namespace, leases, pins,
fragmentation) are computed when the metrics registry is collected (``metrics.on_collect``:
a scrape), on the event loop, never on a timer.

This module holds the service's lifecycle, the call plumbing (``_call``, ``_each``,
``_after``), the tick loop and gauges; the handler table and handlers are mixed in from
``service_handlers``, the SSD work (spills, promotion) from ``service_ssd``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from pymooncake.metadata.aio import cancel_and_wait
from pymooncake.obs import metrics
from pymooncake.obs.logging import init_logger
from pymooncake.rpc import RpcClient, RpcServer
from pymooncake.store.config import MasterConfig
from pymooncake.store.errors import StoreError
from pymooncake.store.master.copier import ReplicaCopier
from pymooncake.store.master.core import MasterCore
from pymooncake.store.master.ha import HaConfig, HaController
from pymooncake.store.master.rereplicator import ReReplicator
from pymooncake.store.master.service_handlers import M_LOOKUPS, HandlerMethods, _rpc_error
from pymooncake.store.master.service_ssd import PROMOTE_WAIT_S, SsdMethods

# re-exported from here (they were defined in this module before the split)
__all__ = ["GAUGE_REFRESH_TIMEOUT_S", "M_LOOKUPS", "PROMOTE_WAIT_S", "MasterService", "run_master"]

logger = init_logger(__name__)

GAUGE_REFRESH_TIMEOUT_S = 2.0
"""How long a scrape waits for the event loop to compute the object-table gauges (a scan
of every object) before it serves the previous values. They used to be refreshed every
5 s on the tick loop, whether or not anything scraped: in a P/D replay with ~7.5k KV
blocks stored, 0.25 of the master main thread's 1.69 CPU-s under yappi (issue 16,
session 24), and a stall of the loop that grows with the table."""

M_OBJECTS = metrics.gauge("pymooncake_store_objects", "Objects in the master's table")
M_BYTES = metrics.gauge("pymooncake_store_used_bytes", "Bytes used, by tier", ["tier"])
M_CAPACITY = metrics.gauge("pymooncake_store_capacity_bytes", "Mounted DRAM capacity (bytes)")
M_EVICTIONS = metrics.counter("pymooncake_store_evictions_total",
                              "Objects evicted from DRAM, by reason", ["reason"])
M_LEASED = metrics.gauge("pymooncake_store_leased_objects", "Objects holding a read lease")
M_PINNED = metrics.gauge("pymooncake_store_pinned_objects", "Pinned objects, by kind", ["kind"])
M_NAMESPACE = metrics.gauge("pymooncake_store_namespace_bytes",
                            "Bytes held per key namespace (prefix before '/' or ':')",
                            ["namespace"])
M_FRAG = metrics.gauge("pymooncake_store_fragmentation_ratio",
                       "1 - largest free range / free bytes, per segment", ["segment"])
M_EVICTION_STALLS = metrics.counter(
    "pymooncake_store_eviction_stalls_total",
    "Watermark eviction passes over the watermark that found no evictable object")
M_DROPPED_CLIENTS = metrics.counter("pymooncake_store_dropped_clients_total",
                                    "Clients dropped after missing heartbeats")


class MasterService(HandlerMethods, SsdMethods):
    """Serve a ``MasterCore`` on ``config.host:config.port`` (``port=0`` picks one).

    ``clock`` gives seconds (monotonic); tests may pass a fake. ``await start()``, then
    ``port``; ``await stop()``.
    """

    def __init__(self, config: MasterConfig, clock: Callable[[], float] = time.monotonic,
                 tick_interval_s: float | None = None, ha: HaConfig | None = None) -> None:
        self.config = config
        self.core = MasterCore(config)
        self.ha_config = ha
        self.ha: HaController | None = None
        self._clock = clock
        self.tick_interval_s = tick_interval_s or min(0.1, config.client_ttl_s / 4)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._unhook_gauges: Callable[[], None] | None = None
        self._gauges_pending: concurrent.futures.Future[None] | None = None
        self._gauges_lock = threading.Lock()
        self._stall_logged = float("-inf")
        self.server = RpcServer(config.host, config.port, poll_s=config.rpc_poll_s)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._spills: set[asyncio.Task[Any]] = set()
        self._promotions: dict[str, asyncio.Task[Any]] = {}
        self._peers: dict[tuple[str, int], RpcClient] = {}
        self._ticker: asyncio.Task[None] | None = None
        self.copier = ReplicaCopier(self, host=config.host)
        """Replica copies (hot-block replication); set ``copier.metadata_url`` to enable."""
        self.rereplicator = ReReplicator(self, config.rereplicate_budget_bytes)
        """Restores replicas a failure took, through ``copier`` (issue 17)."""
        self._register()

    @property
    def port(self) -> int:
        return self.server.port

    def now_ms(self) -> float:
        return self._clock() * 1000.0

    async def start(self) -> None:
        """Listen (and, with ``ha``, join the election as a follower). Raises ``OSError``
        when the port is taken and ``MetadataError`` when etcd cannot be reached."""
        await self.server.start()
        if self.ha_config is not None:
            self.ha = HaController(self, self.ha_config,
                                   f"{self.config.host}:{self.server.port}")
            try:
                await self.ha.start()
            except BaseException:
                await self.server.stop()
                raise
        self._ticker = asyncio.ensure_future(self._tick_loop())
        self._loop, self._loop_thread = asyncio.get_running_loop(), threading.get_ident()
        self._unhook_gauges = metrics.on_collect(self._refresh_gauges)
        logger.info("store master listening on %s:%d%s", self.config.host, self.server.port,
                    " (HA follower until elected)" if self.ha else "")

    def install_core(self, core: MasterCore) -> None:
        """Serve ``core`` from now on (HA promotion and step-down)."""
        for t in [*self._promotions.values(), *self._spills]:
            t.cancel()  # SSD work ordered by the previous core is not this one's
        self._promotions.clear()
        self.core = core

    async def stop(self) -> None:
        if self._unhook_gauges is not None:
            self._unhook_gauges()
            self._unhook_gauges = None
        if self._ticker is not None:  # (bounded; our own cancellation goes through)
            await cancel_and_wait(self._ticker, "master tick loop")
        for t in list(self._tasks) + list(self._spills):
            t.cancel()
        if self.ha is not None:
            await self.ha.stop()
        await self.server.stop()
        self.rereplicator.stop()
        self.copier.close()
        for c in self._peers.values():
            with contextlib.suppress(Exception):
                await c.close()

    # -- plumbing ----------------------------------------------------------------------
    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            out = fn(*args)
        except StoreError as e:
            raise _rpc_error(e) from None
        finally:
            self._after()
        return out

    @staticmethod
    def _each(fn: Callable[[Any], Any], items: Any) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for item in items:
            try:
                out.append({"r": fn(item)})
            except StoreError as e:
                out.append({"e": [int(e.code), e.message]})
        return out

    def _after(self) -> None:
        """Carry out the core's pending effects (spills, SSD deletes, metrics)."""
        durable = self.ha.record() if self.ha is not None else None
        e = self.core.effects
        if not (e.spills or e.ssd_deletes or e.evicted or e.dropped_clients
                or e.stalled_passes):
            return
        eff = self.core.drain_effects()
        if eff.stalled_passes:
            M_EVICTION_STALLS.inc(eff.stalled_passes)
            now = self._clock()
            if now - self._stall_logged >= 10.0:
                self._stall_logged = now
                logger.warning("store over the eviction watermark but no object can be "
                               "evicted (all leased, pinned or moving); puts fail "
                               "NO_AVAILABLE_HANDLE until leases lapse")
        for reason, n in eff.evicted.items():
            M_EVICTIONS.labels(reason).inc(n)
        if eff.dropped_clients:
            M_DROPPED_CLIENTS.inc(len(eff.dropped_clients))
            logger.info("dropped silent clients %s", eff.dropped_clients)
        for order in eff.spills:
            t = asyncio.ensure_future(self._spill(order))
            self._spills.add(t)
            t.add_done_callback(self._spills.discard)
        by_seg: dict[str, list[str]] = {}
        for seg, key in eff.ssd_deletes:
            by_seg.setdefault(seg, []).append(key)
        for seg, keys in by_seg.items():
            self._spawn(self._when_durable(durable, self._ssd_call(
                seg, "ssd_delete", {"keys": keys})))

    @staticmethod
    async def _when_durable(fut: Any, coro: Any) -> Any:
        """Run ``coro`` once the journal holds the change that asked for it (HA: an SSD
        file is deleted only after its object's removal is durable); never when that
        journal write failed."""
        if fut is not None:
            try:
                await asyncio.shield(fut)
            except Exception:  # noqa: BLE001 - not durable: the successor may need it
                coro.close()
                return None
        return await coro

    def _spawn(self, coro: Any) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # -- background --------------------------------------------------------------------

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.tick_interval_s)
            if self.ha is not None and not self.ha.leading:
                continue
            try:
                now = self.now_ms()
                self.core.tick(now)
                self._after()
                self.rereplicator.poke(now / 1000.0)
            except Exception:  # never let the ticker die
                logger.exception("master tick failed")

    def _refresh_gauges(self) -> None:
        """``metrics.on_collect`` hook (the scraping thread): ``_update_gauges`` on the event
        loop, which owns the tables, waiting at most ``GAUGE_REFRESH_TIMEOUT_S``; directly
        when called on the loop itself (``metrics.render()`` from a handler or a test).
        While one scan is queued (the loop busy), later scrapes wait for that one rather
        than queue more.
        A follower (HA) leaves the gauges alone, as its tick loop does."""
        loop = self._loop
        if loop is None or (self.ha is not None and not self.ha.leading):
            return
        if threading.get_ident() == self._loop_thread:
            self._update_gauges(self.now_ms())
            return
        with self._gauges_lock:   # scrapes while one scan is queued wait for that one
            done = self._gauges_pending
            if done is None or done.done():
                done = concurrent.futures.Future()

                def run(done: concurrent.futures.Future[None] = done) -> None:
                    try:
                        self._update_gauges(self.now_ms())
                        done.set_result(None)
                    except BaseException as e:  # noqa: BLE001 - to the scraping thread
                        done.set_exception(e)
                try:
                    loop.call_soon_threadsafe(run)
                except RuntimeError:        # the loop is closed: the master has stopped
                    return
                self._gauges_pending = done
        try:
            done.result(timeout=GAUGE_REFRESH_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            logger.warning("metrics scrape: the master's event loop did not compute the "
                           "gauges within %.1f s; serving the previous values",
                           GAUGE_REFRESH_TIMEOUT_S)

    def _update_gauges(self, now_ms: float) -> None:
        st = self.core.stats(now_ms)
        M_OBJECTS.set(st["num_objects"])
        M_BYTES.labels("dram").set(st["dram_used_bytes"])
        M_BYTES.labels("ssd").set(st["ssd_used_bytes"])
        M_CAPACITY.set(st["dram_capacity_bytes"])
        M_LEASED.set(st["num_leased"])
        M_PINNED.labels("soft").set(st["num_soft_pinned"])
        M_PINNED.labels("hard").set(st["num_hard_pinned"])
        for ns, b in st["bytes_per_namespace"].items():
            M_NAMESPACE.labels(ns or "_").set(b)
        for seg, f in st["fragmentation"].items():
            M_FRAG.labels(seg).set(f)


async def run_master(config: MasterConfig, ready: Callable[[int], None] | None = None,
                     ha: HaConfig | None = None) -> None:
    """Run a master until cancelled (the ``pymooncake master`` command)."""
    if config.metrics_port is not None:
        metrics.serve_metrics(config.metrics_port, config.host)
    svc = MasterService(config, ha=ha)
    await svc.start()
    if ready is not None:
        ready(svc.port)
    try:
        await asyncio.Event().wait()
    finally:
        await svc.stop()
