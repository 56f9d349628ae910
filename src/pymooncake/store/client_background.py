"""The Store client's background thread: heartbeats to the master (re-mounting the
segment when the master forgot it), the master's SSD orders for this client's segment,
and the liveness check of other segments' owners (case BUG-34); also the mount and the
start-up SSD recovery of a restarted holder (``_recover_ssd``, issue 17)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from typing import Any

import numpy as np

from pymooncake.obs.logging import init_logger
from pymooncake.rpc import RpcClient, RpcError, RpcServer
from pymooncake.store.client_master import MasterOps
from pymooncake.store.leader import LeaderRpc
from pymooncake.store.protocol import (
    HeartbeatRequest,
    LoadOrder,
    MountRequest,
    SpillOrder,
    SsdRecoverRequest,
)
from pymooncake.store.tiers.ssd import SsdCorrupt, SsdFull

logger = init_logger(__name__)

RECOVER_BATCH = 512
"""SSD objects per ``ssd_recover`` call of a restarted storage process."""



def heartbeat_timeout_s(interval_s: float, rpc_timeout_s: float) -> float:
    """How long one heartbeat waits for its answer (s): the heartbeat interval, at least
    0.5 s and at most the RPC timeout. A heartbeat sent to a leader that froze (SIGSTOP, a
    partition) then times out after about a second and is retried on the new leader
    (``LeaderRpc``: heartbeats are idempotent), instead of after the whole RPC timeout —
    longer than a short ``--client-ttl``, after which the new leader dropped the holder's
    segment and every object on it."""
    return min(rpc_timeout_s, max(0.5, interval_s))

class Background(MasterOps):
    """Heartbeats, segment (re-)mounting, SSD orders and owner liveness."""

    def _mount_request(self) -> MountRequest:
        return MountRequest(self.client_id, self.segment_name, self.local_hostname,
                            self.segment_base, self.global_segment_size,
                            self._ssd_capacity if self.ssd else 0, self.local_hostname,
                            self._rpc_port, self.holder)

    def _mount(self) -> None:
        self._master("mount_segment", self._mount_request())

    def _recover_ssd(self) -> dict[str, Any]:
        """After a restart on the same SSD directory (issue 17): offer the objects the
        verifying start-up scan kept to the master, in batches, as SSD replicas of this
        segment; delete the files it refuses. Corrupt or cut object files were already
        deleted by the scan and are reported here (``skipped``), never registered."""
        assert self.ssd is not None
        rep = self.ssd.last_scan
        sizes = self.ssd.sizes()
        keys = [k for k in sizes if k in rep.checksums]
        for k in sizes.keys() - rep.checksums.keys():  # never verified: not offered
            self.ssd.remove(k)
        out: dict[str, Any] = {"registered": 0, "refused": 0, "skipped": rep.skipped,
                               "removed_bad": rep.removed_bad}
        i = 0
        while True:
            batch = keys[i:i + RECOVER_BATCH]
            i += len(batch)
            res = self._master("ssd_recover", SsdRecoverRequest(
                self.client_id, self.segment_name, self.holder,
                tuple((k, sizes[k], rep.checksums[k]) for k in batch), i >= len(keys)))
            for k, why in zip(batch, res, strict=True):
                if why:
                    logger.info("SSD object %r not registered again (%s): file deleted",
                                k, why)
                    self.ssd.remove(k)
                    out["refused"] += 1
                else:
                    out["registered"] += 1
            if i >= len(keys):
                break
        rep.checksums.clear()
        if rep.skipped:
            logger.warning("SSD recovery in %s skipped %d damaged or stray entries: %s",
                           self.ssd.path, len(rep.skipped), rep.skipped[:20])
        return out

    def _owner_dead(self, segment: str) -> str | None:
        """Liveness check of ``segment``'s owner after a successful move (case BUG-34):
        why it is dead, or ``None`` (alive, on another host, or unknown). Same host only:
        the owner's pid (from its Transfer Engine descriptor, looked up once per segment)
        must exist; a dead owner's shm mapping still holds bytes, but a dead segment's
        replicas must not be relied on before the master drops them at ``client_ttl``.
        Assumes one pid namespace per host id (as the shm transport itself does)."""
        owner = self._owners.get(segment)
        if owner is None:
            self._owner_prefetch([segment])
            fut = self._owner_futs.pop(segment, None)
            if fut is None:
                return None
            try:
                owner = fut.result(self._rpc_timeout)
            except Exception:  # noqa: BLE001 - no answer in time: no verdict
                return None
            if owner is None:
                return None
            self._owners[segment] = owner
        pid, host_id = owner
        if pid <= 0 or host_id != self._host_id or pid == os.getpid():
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            self._owners.pop(segment, None)  # a new owner may publish the name again
            return f"owner pid {pid} of segment {segment!r} is dead"
        except PermissionError:
            pass  # exists, owned by another user
        return None

    def _owner_prefetch(self, segments: list[str]) -> None:
        """Start the owner lookups of ``segments`` not known yet (see ``_owner_dead``)."""
        if self._loop is None or self._dp is None:
            return
        for seg in segments:
            if seg not in self._owners and seg not in self._owner_futs:
                self._owner_futs[seg] = self._dp.lookup_owner(seg, self._loop)

    def _bg_main(self, ready: threading.Event) -> None:
        asyncio.run(self._bg(ready))

    async def _bg(self, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = None
        if self.global_segment_size:
            server = RpcServer("127.0.0.1" if self.local_hostname in ("localhost",)
                               else self.local_hostname, 0)
            server.register("ssd_spill", self._ssd_spill, SpillOrder)
            server.register("ssd_load", self._ssd_load, LoadOrder)
            server.register("ssd_delete", self._ssd_delete)
            await server.start()
            self._rpc_port = server.port
        master = LeaderRpc(self.master_locator, self._rpc_timeout)
        ready.set()
        try:
            while not self._stop.is_set():
                with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self._hb_interval)
                if self._stop.is_set() or not self.started:
                    continue
                try:  # a short timeout: a frozen leader is left for the next one well
                    # within the master's client TTL, which drops a silent holder's segment
                    res = await self._unless_stopped(master.call(
                        "heartbeat", HeartbeatRequest(self.client_id),
                        heartbeat_timeout_s(self._hb_interval, self._rpc_timeout)))
                    if res is None:     # closing: a heartbeat still looking for a leader
                        continue
                    if not res.get("known", True) and self.global_segment_size:
                        await self._remount(master)
                except RpcError as e:
                    logger.debug("heartbeat failed: %s", e)
        finally:
            with contextlib.suppress(Exception):
                await master.close()
            if server is not None:
                await server.stop()

    async def _unless_stopped(self, coro: Any) -> Any:
        """``await coro``, or ``None`` (``coro`` cancelled) once ``close`` sets the stop
        event first: a heartbeat failing over for up to 10 s must not hold up a close."""
        assert self._stop is not None
        call = asyncio.ensure_future(coro)
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({call, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not call.done():
            call.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await call
            return None
        return call.result()

    async def _remount(self, master: RpcClient) -> None:
        """The master forgot us (restart without snapshot): its objects are gone, so our
        segment's bytes and SSD files are free space; mount again (case BUG-31)."""
        if self.ssd is not None:
            await asyncio.to_thread(self.ssd.clear)
        logger.info("master forgot client %s; re-mounting %s", self.client_id,
                    self.segment_name)
        await master.call("mount_segment", self._mount_request())

    def _seg_view(self, addr: int, length: int) -> np.ndarray:
        off = addr - self.segment_base
        if self._segment_arr is None or off < 0 or off + length > self.global_segment_size:
            raise RpcError("INVALID_PARAMS", f"range {addr}+{length} outside this segment")
        return self._segment_arr[off:off + length]

    async def _ssd_spill(self, order: SpillOrder) -> dict[str, Any]:
        if self.ssd is None:
            return {"ok": False, "dropped": []}
        if not self._ssd_ready.is_set():  # the recovery may still delete a refused file
            await asyncio.to_thread(self._ssd_ready.wait, 30.0)
        data = self._seg_view(order.addr, order.length).tobytes()
        try:
            dropped = await self.ssd.aput(order.key, data)
        except (SsdFull, OSError) as e:
            logger.warning("spill of %r failed: %s", order.key, e)
            return {"ok": False, "dropped": []}
        return {"ok": True, "dropped": dropped}

    async def _ssd_load(self, order: LoadOrder) -> dict[str, Any]:
        if self.ssd is None:
            return {"ok": False}
        try:
            data = await self.ssd.aget(order.key)
        except SsdCorrupt as e:  # never hand damaged bytes on (case BUG-60)
            logger.warning("SSD copy of %r is corrupt, dropped: %s", order.key, e)
            return {"ok": False, "corrupt": True}
        if data is None or len(data) != order.length:
            return {"ok": False}
        self._seg_view(order.addr, order.length)[:] = np.frombuffer(data, dtype=np.uint8)
        return {"ok": True}

    async def _ssd_delete(self, params: dict[str, Any]) -> int:
        if self.ssd is None:
            return 0
        n = 0
        for key in params.get("keys", []):
            n += await self.ssd.aremove(str(key))
        return n
