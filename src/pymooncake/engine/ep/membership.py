"""Which EP ranks serve the front (``engine.ep.dispatch.RemoteExperts``): heartbeats, a
rank's death and rejoin, and the expert placement re-planned over the live ranks.

Holds ``RankMembership``, the mixin of ``RemoteExperts`` with ``_mark_dead``, the
heartbeat loop (``ep.ping`` every ``heartbeat_s``; no answer for ``deadline_s`` is death;
a new incarnation or an answer again is a rejoin), the re-planner thread and
``_rebalance`` (plan, load the new copies, switch, drop the old ones), and the views
``alive_ranks`` / ``missing``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from pymooncake.engine.ep import placement as pl
from pymooncake.obs.logging import init_logger
from pymooncake.rpc import RpcError

if TYPE_CHECKING:
    from pymooncake.engine.ep.dispatch import EPEvents, EPOptions, RankState

logger = init_logger("pymooncake.engine.ep.dispatch")


class RankMembership:
    """Rank liveness and placement of ``RemoteExperts`` (a mixin; ``RemoteExperts``
    sets the attributes below and supplies ``_call`` / ``_acall``, its RPC plumbing)."""

    opts: EPOptions
    ranks: list[RankState]
    moe_layers: list[int]
    num_experts: int
    dtype: torch.dtype
    placement: pl.Placement
    loads: list[list[float]]
    events: EPEvents
    metadata: str
    owner: str
    _lock: threading.Lock
    _replan: threading.Event
    _replan_reason: str
    _closed: threading.Event

    def _mark_dead(self, r: RankState, why: str) -> None:
        with self._lock:
            if not r.alive:
                return
            r.alive = False
            r.died_at = time.monotonic()
            self.events.deaths.append((r.rank, r.died_at))
        logger.warning("EP rank %d (%s:%d) is dead: %s", r.rank, r.host, r.port, why)
        if self.opts.replan_on_failure:
            self._request_replan(f"rank {r.rank} died")

    def _request_replan(self, reason: str) -> None:
        self._replan_reason = reason
        self._replan.set()

    async def _heartbeats(self) -> None:
        while not self._closed.is_set():
            await asyncio.sleep(self.opts.heartbeat_s)
            await asyncio.gather(*(self._beat(r) for r in self.ranks))

    async def _beat(self, r: RankState) -> None:
        now = time.monotonic()
        try:
            pong = await self._acall(r, "ep.ping", {"owner": self.owner}, self.opts.deadline_s)
        except RpcError:
            if r.alive and now - r.last_ok > self.opts.deadline_s:
                self._mark_dead(r, f"no heartbeat for {now - r.last_ok:.2f} s")
            return
        owner = pong.get("owner")
        if owner is not None and owner != self.owner and not r.joining:
            if r.alive:  # another front took this rank over: not ours any more
                self._mark_dead(r, "taken over by another front")
            return
        r.last_ok = time.monotonic()
        inc = str(pong.get("incarnation", ""))
        if (not r.alive or inc != r.incarnation) and not r.joining:
            rejoined = inc != r.incarnation
            r.incarnation, r.pid = inc, int(pong.get("pid", 0))
            logger.warning("EP rank %d (%s:%d) %s", r.rank, r.host, r.port,
                           "rejoined (new process)" if rejoined else "answers again")
            with self._lock:
                r.alive = False  # routed to once the re-balance placed experts on it
                r.joining = True
            self._request_replan(f"rank {r.rank} rejoined")

    # -- placement -------------------------------------------------------------------
    def _replanner(self) -> None:
        while True:
            self._replan.wait()
            if self._closed.is_set():
                return
            self._replan.clear()
            try:
                self._rebalance(self._replan_reason)
            except Exception:  # noqa: BLE001 (keep serving; the next event retries)
                logger.exception("EP re-balance failed")

    def _rebalance(self, reason: str) -> None:
        """Plan over the ranks that answer, load new copies, switch, drop old copies."""
        t0 = time.monotonic()
        with self._lock:
            loads = [list(x) for x in self.loads]
        candidates = [r for r in self.ranks if r.alive or r.joining]
        if not candidates:
            logger.error("EP re-balance (%s): no live rank", reason)
            return
        plan = pl.plan_placement(len(self.moe_layers), self.num_experts,
                                 [r.rank for r in candidates], self.opts.slots_per_rank,
                                 loads if any(any(x) for x in loads) else None)
        ok = []
        for r in candidates:  # phase 1: add the new copies (old ones stay routable)
            want = [[li, e] for li, e in self._to_decoder(pl.rank_experts(plan, r.rank))]
            try:
                self._call(r, "ep.hold", {"metadata": self.metadata, "experts": want,
                                          "dtype": str(self.dtype).removeprefix("torch."),
                                          "exact": False, **self._claim()}, 30.0, mark=False)
                ok.append(r)
            except RpcError as e:
                logger.warning("EP rank %d could not load its experts: %s", r.rank, e.message)
        if len(ok) < len(candidates):  # plan again without the ranks that failed
            plan = pl.plan_placement(len(self.moe_layers), self.num_experts,
                                     [r.rank for r in ok], self.opts.slots_per_rank,
                                     loads if any(any(x) for x in loads) else None)
        with self._lock:  # phase 2: switch (between layer calls: run() holds the lock)
            self.placement = plan
            for r in ok:
                r.alive = True
            for r in candidates:
                r.joining = False
        for r in ok:  # phase 3: drop the copies no longer placed there
            want = [[li, e] for li, e in self._to_decoder(pl.rank_experts(plan, r.rank))]
            try:
                self._call(r, "ep.hold", {"metadata": self.metadata, "experts": want,
                                          "dtype": str(self.dtype).removeprefix("torch."),
                                          "exact": True, **self._claim()}, 30.0, mark=False)
            except RpcError as e:
                logger.warning("EP rank %d could not drop experts: %s", r.rank, e.message)
        self.events.replans.append((reason, t0, time.monotonic()))
        logger.info("EP placement (%s) over ranks %s in %.3f s", reason,
                    [r.rank for r in ok], time.monotonic() - t0)

    def _claim(self) -> dict[str, Any]:
        return {"owner": self.owner, "take_over": self.opts.take_over,
                "lease_s": self.opts.lease_s}

    def _to_decoder(self, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        return [(self.moe_layers[i], e) for i, e in pairs]

    def alive_ranks(self) -> set[int]:
        return {r.rank for r in self.ranks if r.alive}

    def missing(self) -> list[tuple[int, int]]:
        """``(decoder layer, expert)`` with no copy on a live rank."""
        with self._lock:
            return self._to_decoder(pl.missing_experts(self.placement, self.alive_ranks()))
