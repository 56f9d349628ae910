"""The master's SSD work by RPC: ``MasterService``'s method group for spills and loads back.

Mixed into ``MasterService`` (``service.py``). A ``SpillOrder`` of the core goes to the
storage process that owns the segment (``ssd_spill``) and its outcome back to the core; a
get of an object held only on SSD loads it back into its owner's DRAM first (promotion,
``ssd_load``), one load per key at a time; a put that finds no room while spills are in
flight waits for them once (``_wait_spills``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pymooncake.obs.logging import init_logger
from pymooncake.rpc import RpcClient, RpcError
from pymooncake.store.config import MasterConfig
from pymooncake.store.errors import ErrorCode, StoreError
from pymooncake.store.master.service_handlers import M_LOOKUPS
from pymooncake.store.protocol import TIER_DRAM, ReplicaList, SpillOrder

if TYPE_CHECKING:
    from pymooncake.store.master.core import MasterCore

logger = init_logger(__name__)

PROMOTE_WAIT_S = 3.0
"""Longest a get of an SSD-resident object waits for DRAM room (leases to lapse)."""


class SsdMethods:
    """Mixed into ``MasterService``: storage peers, spills, promotion."""

    config: MasterConfig
    core: MasterCore
    _clock: Callable[[], float]
    _spills: set[asyncio.Task[Any]]
    _promotions: dict[str, asyncio.Task[Any]]
    _peers: dict[tuple[str, int], RpcClient]

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
