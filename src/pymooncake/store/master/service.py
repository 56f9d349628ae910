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
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Callable
from typing import Any

from pymooncake.metadata.aio import cancel_and_wait
from pymooncake.obs import metrics
from pymooncake.obs.logging import init_logger
from pymooncake.rpc import RpcClient, RpcError, RpcServer, from_wire
from pymooncake.store.config import MasterConfig, ReplicateConfig
from pymooncake.store.errors import ErrorCode, StoreError
from pymooncake.store.master import rejoin
from pymooncake.store.master.copier import ReplicaCopier
from pymooncake.store.master.core import MasterCore
from pymooncake.store.master.ha import HaConfig, HaController
from pymooncake.store.master.rereplicator import ReReplicator
from pymooncake.store.protocol import (
    TIER_DRAM,
    BatchExistRequest,
    BatchPutEndRequest,
    BatchPutStartRequest,
    ExistRequest,
    HeartbeatRequest,
    KeyRequest,
    KeysRequest,
    MountRequest,
    PutEndRequest,
    PutHandle,
    PutStartRequest,
    RemoveAllRequest,
    RemoveRequest,
    ReplicaList,
    SpillOrder,
    UnmountRequest,
)

logger = init_logger(__name__)

GAUGE_INTERVAL_S = 1.0
"""The object-table gauges (objects, bytes per namespace, pins, fragmentation) are refreshed
at most this often: computing them scans every object, and at the 0.1 s tick that scan was
most of the master's CPU with a few thousand KV blocks stored (py-spy, bench serving)."""

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
M_LOOKUPS = metrics.counter("pymooncake_store_lookups_total",
                            "get_replica_list answers, by result (hit/miss)", ["result"])
_LOOKUP = {r: M_LOOKUPS.labels(r) for r in ("hit", "miss", "error")}
M_EVICTION_STALLS = metrics.counter(
    "pymooncake_store_eviction_stalls_total",
    "Watermark eviction passes over the watermark that found no evictable object")
M_DROPPED_CLIENTS = metrics.counter("pymooncake_store_dropped_clients_total",
                                    "Clients dropped after missing heartbeats")


PROMOTE_WAIT_S = 3.0
"""Longest a get of an SSD-resident object waits for DRAM room (leases to lapse)."""


_DEFAULT_CONFIG = ReplicateConfig()
_NONE: frozenset[str] = frozenset()


def _config(raw: dict[str, Any] | None) -> ReplicateConfig:
    if raw is None:
        return _DEFAULT_CONFIG
    try:
        return from_wire(ReplicateConfig, raw, "config")
    except ValueError as e:
        raise RpcError("INVALID_ARGUMENT", str(e)) from None


def _rpc_error(e: StoreError) -> RpcError:
    return RpcError(e.code.name, e.message, {"code": int(e.code)})


class MasterService:
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
        self._gauges_ms = float("-inf")
        self._stall_logged = float("-inf")
        self.server = RpcServer(config.host, config.port)
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
        logger.info("store master listening on %s:%d%s", self.config.host, self.server.port,
                    " (HA follower until elected)" if self.ha else "")

    def install_core(self, core: MasterCore) -> None:
        """Serve ``core`` from now on (HA promotion and step-down)."""
        for t in [*self._promotions.values(), *self._spills]:
            t.cancel()  # SSD work ordered by the previous core is not this one's
        self._promotions.clear()
        self.core = core

    async def stop(self) -> None:
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

    def _register(self) -> None:
        server = self.server

        class _Gated:  # with HA, every call but ping/ha_status is gated and journaled
            @staticmethod
            def register(name: str, fn: Callable[..., Any], ptype: type | None = None) -> None:
                server.register(name, self._gated(fn), ptype)

        s = _Gated
        server.register("ping", lambda p: "pong")
        server.register("ha_status", lambda p: self.ha.status() if self.ha else
                        {"role": "standalone"})
        s.register("mount_segment", self._mount, MountRequest)
        s.register("unmount_segment", self._unmount, UnmountRequest)
        s.register("heartbeat", self._heartbeat, HeartbeatRequest)
        s.register("put_start", self._put_start, PutStartRequest)
        s.register("batch_put_start", self._batch_put_start, BatchPutStartRequest)
        s.register("put_end", self._put_end, PutEndRequest)
        s.register("batch_put_end", self._batch_put_end, BatchPutEndRequest)
        s.register("put_revoke", self._put_revoke, PutEndRequest)
        s.register("batch_put_revoke", self._batch_put_revoke, BatchPutEndRequest)
        s.register("get_replica_list", self._get_replica_list, KeyRequest)
        s.register("batch_get_replica_list", self._batch_get_replica_list, KeysRequest)
        s.register("load_replica_list", self._load_replica_list, KeysRequest)
        s.register("exist", self._exist, ExistRequest)
        s.register("batch_exist", self._batch_exist, BatchExistRequest)
        s.register("remove", self._remove, RemoveRequest)
        s.register("batch_remove", self._batch_remove, KeysRequest)
        s.register("remove_all", self._remove_all, RemoveAllRequest)
        s.register("release_leases", self._release_leases, KeysRequest)
        s.register("list_keys", lambda p: self.core.list_keys())
        s.register("stats", lambda p: self.core.stats(self.now_ms()))
        self.copier.register(s)     # replica_segments, replicate (hot-block replication)
        rejoin.register(s, self)    # ssd_recover, report_bad_replica (issue 17)

    def _gated(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """With HA: refuse unless leading; answer only after the changes the call made
        (and every change queued before it) are durable in the journal."""
        if self.ha_config is None:
            return fn

        async def handler(p: Any) -> Any:
            ha = self.ha
            if ha is None:
                raise RpcError(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS.name,
                               "master is starting", {"code": -1010, "leader": ""})
            await ha.gate()
            core = self.core
            try:
                out = fn(p)
                if inspect.isawaitable(out):
                    out = await out
            finally:
                fut = ha.record() if self.core is core else None
            if fut is not None:
                await ha.durable(fut)
            elif self.core is not core or not ha.leading:
                await ha.gate()  # stepped down meanwhile: the answer may be stale
            return out

        return handler

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

    def _peer(self, segment: str) -> RpcClient | None:
        seg = self.core.pool.segments.get(segment)
        if seg is None or not seg.rpc_port:
            return None
        addr = (seg.rpc_host or seg.host, seg.rpc_port)
        c = self._peers.get(addr)
        if c is None:
            c = self._peers[addr] = RpcClient(addr[0], addr[1], timeout_s=30.0)
        return c

    async def _ssd_call(self, segment: str, method: str, params: Any) -> Any:
        peer = self._peer(segment)
        if peer is None:
            raise RpcError("SEGMENT_NOT_FOUND", f"segment {segment!r} has no storage RPC")
        return await peer.call(method, params)

    async def _spill(self, order: SpillOrder) -> None:
        ok, dropped = False, []
        try:
            res = await self._ssd_call(order.segment, "ssd_spill", order)
            ok, dropped = bool(res.get("ok")), list(res.get("dropped", []))
        except Exception as e:  # a dead owner: the object is dropped like a plain eviction
            logger.warning("spill of %r to %s failed: %s", order.key, order.segment, e)
        alive = self.core.spill_done(order.key, order.generation, order.segment, ok, dropped,
                                     self.now_ms())
        if ok and not alive:
            self._spawn(self._ssd_call(order.segment, "ssd_delete", {"keys": [order.key]}))
        self._after()

    async def _wait_spills(self) -> bool:
        if not self._spills:
            return False
        await asyncio.wait(list(self._spills), timeout=30.0)
        return True

    # -- handlers ----------------------------------------------------------------------

    def _mount(self, p: MountRequest) -> dict[str, Any]:
        self._call(self.core.mount_segment, p.client_id, p.segment, p.host, p.base_addr,
                   p.size_bytes, self.now_ms(), p.ssd_capacity_bytes, p.rpc_host, p.rpc_port,
                   p.holder)
        return {"ok": True}

    def _unmount(self, p: UnmountRequest) -> int:
        return self._call(self.core.unmount_segment, p.client_id, p.segment, self.now_ms())

    def _heartbeat(self, p: HeartbeatRequest) -> dict[str, Any]:
        return {"known": self.core.heartbeat(p.client_id, self.now_ms())}

    def _put_start(self, p: PutStartRequest) -> Any:
        """A plain handler (no task per put); when the store is full while spills are in
        flight it returns the coroutine that waits for them once and tries again."""
        cfg = _config(p.config)
        try:
            return self._call(self.core.put_start, p.client_id, p.key, p.size_bytes, cfg,
                              self.now_ms())
        except RpcError as e:
            if e.code != ErrorCode.NO_AVAILABLE_HANDLE.name or not self._spills:
                raise
            return self._put_start_again(e, p, cfg)

    async def _put_start_again(self, err: RpcError, p: PutStartRequest,
                               cfg: ReplicateConfig) -> PutHandle:
        if not await self._wait_spills():
            raise err
        return self._call(self.core.put_start, p.client_id, p.key, p.size_bytes, cfg,
                          self.now_ms())

    def _batch_put_start(self, p: BatchPutStartRequest) -> Any:
        """As ``_put_start``, per key; the keys that found no room while spills are in
        flight are tried once more after them (by the returned coroutine)."""
        keys, sizes, cid, cfg = p.keys, p.sizes_bytes, p.client_id, _config(p.config)
        now = self.now_ms()
        start = self.core.put_start
        out = self._each(lambda i: start(cid, keys[i], sizes[i], cfg, now), range(len(keys)))
        retry = [i for i, r in enumerate(out)
                 if "e" in r and r["e"][0] == int(ErrorCode.NO_AVAILABLE_HANDLE)]
        self._after()
        if retry and self._spills:
            return self._batch_put_start_again(out, retry, p, cfg)
        return out

    async def _batch_put_start_again(self, out: list, retry: list[int],
                                     p: BatchPutStartRequest, cfg: ReplicateConfig) -> Any:
        if await self._wait_spills():
            start = self.core.put_start
            now = self.now_ms()
            again = self._each(lambda i: start(p.client_id, p.keys[i], p.sizes_bytes[i], cfg,
                                               now), retry)
            for i, r in zip(retry, again, strict=True):
                out[i] = r
            self._after()
        return out

    def _put_end(self, p: PutEndRequest) -> bool:
        self._call(self.core.put_end, p.client_id, p.key, p.generation, self.now_ms(),
                   p.checksum)
        return True

    def _batch_put_end(self, p: BatchPutEndRequest) -> Any:
        keys, gens, cid = p.keys, p.generations, p.client_id
        sums = p.checksums if p.checksums is not None else (None,) * len(keys)
        now = self.now_ms()
        end = self.core.put_end
        out = self._each(lambda i: end(cid, keys[i], gens[i], now, sums[i]),
                         range(len(keys)))
        self._after()
        return out

    def _put_revoke(self, p: PutEndRequest) -> bool:
        self._call(self.core.put_revoke, p.client_id, p.key, p.generation, self.now_ms())
        return True

    def _batch_put_revoke(self, p: BatchPutEndRequest) -> Any:
        now = self.now_ms()
        out = self._each(lambda kg: self.core.put_revoke(p.client_id, kg[0], kg[1], now),
                         zip(p.keys, p.generations, strict=True))
        self._after()
        return out

    async def _lookup(self, client_id: str, key: str) -> ReplicaList:
        """Replica list of ``key``; loads an SSD-only object back into DRAM first."""
        try:
            rl = self.core.get_replica_list(client_id, key, self.now_ms())
        except StoreError as e:
            if e.code == ErrorCode.OBJECT_NOT_FOUND:
                M_LOOKUPS.labels("miss").inc()
            raise
        if any(r.tier == TIER_DRAM for r in rl.replicas):
            M_LOOKUPS.labels("hit").inc()
            return rl
        task = self._promotions.get(key)
        if task is None:
            task = asyncio.ensure_future(self._promote(key))
            self._promotions[key] = task
            task.add_done_callback(lambda _t: self._promotions.pop(key, None))
        await asyncio.shield(task)
        rl = self.core.get_replica_list(client_id, key, self.now_ms())
        M_LOOKUPS.labels("hit").inc()
        return rl

    async def _promote(self, key: str) -> None:
        # Room may be held by spills in flight or by read leases about to lapse: wait for
        # those, bounded by one lease TTL (at most PROMOTE_WAIT_S), then give up.
        deadline = self._clock() + min(PROMOTE_WAIT_S,
                                       self.config.default_kv_lease_ttl_ms / 1000.0 + 0.2)
        while True:
            try:
                order = self.core.promote_start(key, self.now_ms())
                break
            except StoreError as e:
                self._after()
                if e.code != ErrorCode.NO_AVAILABLE_HANDLE:
                    raise
                if not await self._wait_spills():
                    if self._clock() >= deadline:
                        raise
                    await asyncio.sleep(0.02)
        self._after()
        if order is None:
            return
        ok = corrupt = False
        try:
            res = await self._ssd_call(order.segment, "ssd_load", order)
            ok, corrupt = bool(res.get("ok")), bool(res.get("corrupt"))
        except Exception as e:
            logger.warning("load of %r from SSD on %s failed: %s", key, order.segment, e)
        self.core.promote_done(order, ok, self.now_ms())
        self._after()
        if corrupt:  # the SSD copy failed its checksum: an error, never the bytes (BUG-60)
            raise StoreError(ErrorCode.CHECKSUM_MISMATCH,
                             f"{key!r}: the SSD copy failed its checksum and was dropped")
        if not ok:
            raise StoreError(ErrorCode.OBJECT_NOT_FOUND, f"{key!r} could not be read from SSD")

    def _read(self, client_id: str, key: str, now: float) -> ReplicaList:
        """A published object's readable DRAM replicas and a read lease; ``promote`` set
        when it lives only on SSD (the client then asks ``load_replica_list``, which waits
        for the load)."""
        try:
            obj = self.core.read_object(client_id, key, now)
        except StoreError as e:
            _LOOKUP["miss" if e.code == ErrorCode.OBJECT_NOT_FOUND else "error"].inc()
            raise
        reps = tuple(r.desc() for r in obj.replicas if r.complete and r.tier == TIER_DRAM)
        if not reps:
            return ReplicaList(key, 0, 0, (), 0.0, None, True)
        _LOOKUP["hit"].inc()
        return ReplicaList(key, obj.size_bytes, obj.generation, reps,
                           self.config.default_kv_lease_ttl_ms, obj.checksum)

    def _get_replica_list(self, p: KeyRequest) -> ReplicaList:
        return self._call(self._read, p.client_id, p.key, self.now_ms())

    def _batch_get_replica_list(self, p: KeysRequest) -> Any:
        cid, now = p.client_id, self.now_ms()
        return self._each(lambda k: self._read(cid, k, now), p.keys)

    async def _load_replica_list(self, p: KeysRequest) -> Any:
        """Load SSD-only objects back, all keys at once: each load waits at most one
        ``PROMOTE_WAIT_S`` for room, so the whole answer does too (one key after another,
        a batch of mostly-spilled keys outlived the client's RPC timeout, case BUG-62).
        A key that finds no room answers ``NO_AVAILABLE_HANDLE`` (retryable)."""
        async def one(key: str) -> dict[str, Any]:
            try:
                rl = await self._lookup(p.client_id, key)
            except StoreError as e:
                return {"e": [int(e.code), e.message]}
            return {"r": ReplicaList(key, rl.size_bytes, rl.generation,
                                     tuple(r for r in rl.replicas if r.tier == TIER_DRAM),
                                     rl.lease_ttl_ms, rl.checksum)}
        return list(await asyncio.gather(*(one(k) for k in p.keys)))

    def _exist(self, p: ExistRequest) -> bool:
        return self._call(self.core.exist, p.client_id, p.key, self.now_ms(),
                          frozenset(p.exclude_segments) if p.exclude_segments else _NONE)

    def _batch_exist(self, p: BatchExistRequest) -> Any:
        cid, now = p.client_id, self.now_ms()
        ex = frozenset(p.exclude_segments) if p.exclude_segments else _NONE
        return self._each(lambda k: self.core.exist(cid, k, now, ex), p.keys)

    def _remove(self, p: RemoveRequest) -> bool:
        self._call(self.core.remove, p.key, self.now_ms(), p.force)
        return True

    def _batch_remove(self, p: KeysRequest) -> Any:
        now = self.now_ms()
        out = self._each(lambda k: self.core.remove(k, now), p.keys)
        self._after()
        return out

    def _remove_all(self, p: RemoveAllRequest) -> int:
        return self._call(self.core.remove_all, self.now_ms(), p.force)

    def _release_leases(self, p: KeysRequest) -> int:
        return self.core.release_leases(p.client_id, list(p.keys))

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
                if now - self._gauges_ms >= GAUGE_INTERVAL_S * 1000.0:
                    self._gauges_ms = now
                    self._update_gauges(now)
            except Exception:  # never let the ticker die
                logger.exception("master tick failed")

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
