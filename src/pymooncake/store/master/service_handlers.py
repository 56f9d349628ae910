"""The master's RPC handler table and its handlers: ``MasterService``'s method group.

Mixed into ``MasterService`` (``service.py``). ``_register`` names every RPC method;
``_gated`` wraps them for HA. Each handler takes the typed request (``store.protocol``),
calls the core with ``now_ms`` through ``_call`` (``StoreError`` becomes an ``RpcError``
named by the ``ErrorCode``) and lets ``_after`` carry out the core's effects; a batch
handler answers a list with one ``{"r": result}`` or ``{"e": [code, message]}`` per key.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pymooncake.obs import metrics
from pymooncake.rpc import RpcError, RpcServer, from_wire
from pymooncake.store.config import MasterConfig, ReplicateConfig
from pymooncake.store.errors import ErrorCode, StoreError
from pymooncake.store.master import rejoin
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
    UnmountRequest,
)

if TYPE_CHECKING:
    from pymooncake.store.master.copier import ReplicaCopier
    from pymooncake.store.master.core import MasterCore
    from pymooncake.store.master.ha import HaConfig, HaController
    from pymooncake.store.master.objects import ObjectMeta

M_LOOKUPS = metrics.counter("pymooncake_store_lookups_total",
                            "get_replica_list answers, by result (hit/miss)", ["result"])
_LOOKUP = {r: M_LOOKUPS.labels(r) for r in ("hit", "miss", "error")}

_DEFAULT_CONFIG = ReplicateConfig()
_NONE: frozenset[str] = frozenset()
_BOOL_ONLY = {bool}


def _rpc_error(e: StoreError) -> RpcError:
    return RpcError(e.code.name, e.message, {"code": int(e.code)})


def _config(raw: dict[str, Any] | None) -> ReplicateConfig:
    if raw is None:
        return _DEFAULT_CONFIG
    try:
        return from_wire(ReplicateConfig, raw, "config")
    except ValueError as e:
        raise RpcError("INVALID_ARGUMENT", str(e)) from None


class HandlerMethods:
    """Mixed into ``MasterService``: the handler table, HA gating and the handlers."""

    config: MasterConfig
    core: MasterCore
    server: RpcServer
    ha_config: HaConfig | None
    ha: HaController | None
    copier: ReplicaCopier
    _spills: set[asyncio.Task[Any]]

    # -- handler table ------------------------------------------------------------------

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
        s.register("get_size", self._get_size, ExistRequest)
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

    def _get_size(self, p: ExistRequest) -> int:
        return self._call(self.core.size_of, p.key, self.now_ms(),
                          frozenset(p.exclude_segments) if p.exclude_segments else _NONE)

    def _batch_exist(self, p: BatchExistRequest) -> list[bool | dict[str, Any]]:
        """One answer per key: a bool, or ``{"e": [code, message]}`` for a key refused
        (a bare bool, not ``{"r": bool}``: 16 keys a call are the metadata hot path)."""
        ex = frozenset(p.exclude_segments) if p.exclude_segments else _NONE
        out = self.core.exist_many(p.keys, self.now_ms(), ex)
        if {*map(type, out)} == _BOOL_ONLY:
            return out  # type: ignore[return-value]  # every key good: no per-key step
        return [x if type(x) is bool else {"e": [int(x.code), x.message]}  # type: ignore
                for x in out]

    def _remove(self, p: RemoveRequest) -> bool:
        """Checked now, deleted (table, leases, allocator) once the answer is out: the
        caller does not wait for the free (the server runs it before any other call)."""
        done = False
        try:
            obj = self.core.removable(p.key, self.now_ms(), p.force)
            done = True
        except StoreError as e:
            raise _rpc_error(e) from None
        finally:
            if not done:  # refused: its effects (a lost-SSD key forgotten) now
                self._after()
        self.server.after_reply(self._finish_remove, obj)
        return True

    def _finish_remove(self, obj: ObjectMeta) -> None:
        self.core.finish_remove(obj)
        self._after()

    def _batch_remove(self, p: KeysRequest) -> Any:
        now = self.now_ms()
        out = self._each(lambda k: self.core.remove(k, now), p.keys)
        self._after()
        return out

    def _remove_all(self, p: RemoveAllRequest) -> int:
        return self._call(self.core.remove_all, self.now_ms(), p.force)

    def _release_leases(self, p: KeysRequest) -> int:
        return self.core.release_leases(p.client_id, list(p.keys))
