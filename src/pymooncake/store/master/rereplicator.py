"""The master's re-replication passes (I/O shell of ``store.master.rereplication``).

The service's tick calls ``poke``; while the core reports lost replicas (or the last pass
left work) a pass runs every ``interval_s``: ``plan`` picks the copies within the byte
budget and the copier (``store.master.copier``) makes them, one target segment at a time,
under the copier's lock (one copy batch in flight, shared with ``replicate``).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from pymooncake.obs import metrics
from pymooncake.obs.logging import init_logger
from pymooncake.store.master.rereplication import plan

if TYPE_CHECKING:
    from pymooncake.store.master.core import MasterCore

logger = init_logger(__name__)

MAX_TRIES = 3
"""Failed copies of one key before it waits for the next failure."""

M_UNDER = metrics.gauge("pymooncake_store_under_replicated_objects",
                        "published objects with fewer replicas than their put got "
                        "(as of the last re-replication pass)")
M_REREPLICATIONS = metrics.counter(
    "pymooncake_store_rereplications_total",
    "replicas re-created after a failure took one, by result (ok/failed)", ["result"])


class ReReplicator:
    """Runs the passes for a ``MasterService`` (its tick loop calls ``poke``)."""

    def __init__(self, service: Any, budget_bytes: int = 256 << 20,
                 interval_s: float = 0.5) -> None:
        self.service = service
        self.budget_bytes = budget_bytes
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._next_s = 0.0
        self._tries: dict[str, int] = {}
        self._again = False  # the last pass left work (budget, or copies to check)
        self._warned = False

    def poke(self, now_s: float) -> None:
        """Start a pass when one is due and none is running."""
        core = self.service.core
        if not (core.replicas_lost or self._again) or now_s < self._next_s:
            return
        if self._task is not None and not self._task.done():
            return
        if not self.service.copier.metadata_url:  # count them, say so once, copy none
            core.replicas_lost = self._again = False
            under = plan(core, self.budget_bytes, frozenset()).under_replicated
            M_UNDER.set(under)
            if under and not self._warned:  # (a promotion checks every object: often 0)
                self._warned = True
                logger.warning("%d objects lost replicas but this master copies none (no "
                               "metadata server): they stay under-replicated", under)
            return
        self._next_s = now_s + self.interval_s
        self._task = asyncio.ensure_future(self._pass(core))

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _pass(self, core: MasterCore) -> None:
        try:
            await self._run(core)
        except Exception:  # noqa: BLE001 - the next failure or pass tries again
            logger.exception("re-replication pass failed")

    async def _run(self, core: MasterCore) -> None:
        if core.replicas_lost:  # a new failure: keys given up on are tried again
            self._tries.clear()
        core.replicas_lost = self._again = False
        skip = frozenset(k for k, n in self._tries.items() if n >= MAX_TRIES)
        p = plan(core, self.budget_bytes, skip)
        M_UNDER.set(p.under_replicated)
        if not p.copies:
            return
        retry = p.more
        copier = self.service.copier
        for seg, keys in p.copies.items():
            async with copier._lock:
                if self.service.core is not core:
                    return  # HA step-down: the next leader runs its own passes
                out = await copier._copy(keys, seg)
            for k, res in zip(keys, out, strict=True):
                if "r" in res and res["r"] > 0:
                    M_REREPLICATIONS.labels("ok").inc()
                    self._tries.pop(k, None)
                    retry = True  # the object may still be below its target
                else:
                    M_REREPLICATIONS.labels("failed").inc()
                    self._tries[k] = self._tries.get(k, 0) + 1
                    retry = True
                    logger.warning("re-replication of %r to %s failed: %s", k, seg,
                                   res.get("e"))
        logger.info("re-replication pass: %d copies ordered, %d objects under-replicated",
                    sum(map(len, p.copies.values())), p.under_replicated)
        self._again = retry
