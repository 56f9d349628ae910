"""Master high availability on etcd: leader election, a fenced journal, warm followers.

Several ``pymooncake master --ha`` processes share one metadata service (etcd). Keys, under
``pymooncake/store/<cluster_id>/``:

* ``leader`` — the elected master (``metadata.election``), value msgpack
  ``{"addr": "host:port", "id": ...}``, on the leader's lease (``lease_ttl_s``);
* ``log/<seq>`` — journal entries (``store/master/journal.py``), ``head`` — the last seq;
* ``snapshot`` — ``{"seq": S, "chunks": n, "from": T}`` of the last complete snapshot,
  whose chunks are ``snap/<S>/<i>``; entries ``T..S`` are deleted once it is written.

**Leader.** Every change of its ``MasterCore`` is journaled before the request that made it
is answered (group commit: one etcd transaction per batch of queued changes). Each write
is an etcd transaction that compares the leader key's mod revision with the one its win
created, so a deposed leader's writes are refused by etcd itself. Reads also wait for
the changes queued before them, so nobody reads an object a fail-over could lose.
The leader answers only while ``LeaderElection.valid()`` (its lease cannot have expired
yet, by its own clock, from the *sending* of its last keep-alive). A leader that was
frozen or cut off stops serving before etcd can expire its lease, and steps down (its
core is dropped) at its first failed journal write, lost keep-alive or expired validity.

**Followers** refuse every object and segment call with ``UNAVAILABLE_IN_CURRENT_STATUS``
(retryable) whose ``data["leader"]`` is the leader's ``host:port``. They tail the journal
(etcd watch, and a catch-up read every second, which goes on when the watch cannot be
opened) into a ``MetaIndex``, so promotion only reads what is new. A follower behind the
last snapshot (the entries it missed are trimmed) loads the snapshot and goes on from it.
The tail and the election loop never end on an error: each is logged and retried, and a
background task that ends anyway is logged as an error and shows in ``status()``
(``follower_alive``/``candidate``). Every master campaigns whenever it is not leading,
whatever it did before (stepped down, refused a promotion, lost etcd). On winning the
election a follower first reads up to ``head`` (a missing entry is waited for at most
``catch_up_timeout_s``; then it refuses to lead: ``UNAVAILABLE``, leadership released —
never a partial index; it campaigns again a lease later), restores a core from the index,
journals the objects it refused (bad or overlapping records), and only then answers its
first request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import TYPE_CHECKING, Any

import msgpack

from pymooncake.metadata import MetadataError, MetadataStore, open_metadata
from pymooncake.metadata.aio import STOP_TIMEOUT_S, cancel_and_wait, wait_set
from pymooncake.metadata.election import LeaderElection
from pymooncake.obs import metrics
from pymooncake.obs.logging import init_logger
from pymooncake.rpc import RpcError
from pymooncake.store.errors import ErrorCode
from pymooncake.store.master.core import MasterCore
from pymooncake.store.master.ha_follow import M_SKIPPED, JournalTail
from pymooncake.store.master.ha_journal import (
    Fenced,
    HaConfig,
    HaKeys,
    JournalWriter,
    leader_address,
)
from pymooncake.store.master.journal import LogGap, MetaIndex, restore, take_changes

if TYPE_CHECKING:
    from pymooncake.store.master.service import MasterService

__all__ = ["Fenced", "HaConfig", "HaController", "HaKeys", "leader_address"]

logger = init_logger(__name__)

M_LEADER = metrics.gauge("pymooncake_store_ha_is_leader", "1 while this master is the leader")
M_GAPS = metrics.counter("pymooncake_store_ha_log_gaps_total",
                         "Promotions refused because a journal entry was missing")
M_PROMOTIONS = metrics.counter("pymooncake_store_ha_promotions_total",
                               "Times this master became the leader")
M_STEP_DOWNS = metrics.counter("pymooncake_store_ha_step_downs_total",
                               "Times this master stopped leading, by reason", ["reason"])
M_RESTORE_S = metrics.gauge("pymooncake_store_ha_restore_seconds",
                            "Time of the last promotion: catch-up + restore + journaling (s)")
M_TASK_DEATHS = metrics.counter("pymooncake_store_ha_task_deaths_total",
                                "HA background tasks (follower, election) that ended on an "
                                "error; each is restarted", ["task"])

LOOKUP_TIMEOUT_S = 0.5
"""Longest a refusal waits for etcd to name the leader (else it names none)."""


class HaController:
    """Runs one master's part in HA: campaign, promote, lead, step down, follow.

    ``service`` is the ``MasterService`` whose ``core`` this controller replaces on
    promotion and step-down; ``advertise`` is the ``host:port`` clients reach it at.
    """

    def __init__(self, service: MasterService, cfg: HaConfig, advertise: str) -> None:
        self.service, self.cfg, self.advertise = service, cfg, advertise
        self.keys = HaKeys.of(cfg.cluster_id)
        self.md: MetadataStore = open_metadata(cfg.metadata_url)
        self.candidate = msgpack.packb({"addr": advertise, "id": uuid.uuid4().hex})
        self.election = LeaderElection(self.md, self.keys.leader, self.candidate,
                                       cfg.lease_ttl_s)
        self.tail = JournalTail(self.md, self.keys)
        self.role = "follower"
        self.journal: JournalWriter | None = None
        self.restore_report: Any = None
        self._leader_cache: tuple[float, str | None] = (float("-inf"), None)
        self._campaign: asyncio.Task[Any] | None = None
        self._follower: asyncio.Task[Any] | None = None
        self._stopping = False
        self.last_error = ""

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Join: follow the journal and campaign in the background. Raises
        ``MetadataError`` when the metadata service cannot be reached."""
        await self.md.get(self.keys.head)  # fail fast when etcd is unreachable
        self._start_follower()
        self._start_campaign()

    @property
    def index(self) -> MetaIndex:
        """The journal as applied here (the tail's; the leader's writer appends to it)."""
        return self.tail.index

    def _start_follower(self) -> None:
        self._follower = asyncio.ensure_future(self.tail.run())
        self._follower.add_done_callback(self._task_ended)

    def _start_campaign(self, after_error: bool = False) -> None:
        self._campaign = asyncio.ensure_future(self._run(after_error))
        self._campaign.add_done_callback(self._task_ended)

    def _task_ended(self, task: asyncio.Task[Any]) -> None:
        """Neither loop ends but on stop(): one that does is logged as an error, counted,
        and restarted (the election loop at once; the tail while not leading)."""
        if self._stopping or (task.cancelled() and task is not self._campaign):
            return
        name = "election" if task is self._campaign else "follower"
        err = None if task.cancelled() else task.exception()
        self.last_error = f"{name} task ended: {err!r}"
        M_TASK_DEATHS.labels(name).inc()
        logger.error("HA %s task of %s ended unexpectedly (%r); restarting it", name,
                     self.advertise, err, exc_info=err)
        if task is self._campaign:
            self._start_campaign(after_error=True)
        elif task is self._follower and self.role != "leader":
            self._start_follower()

    async def stop(self) -> None:
        """Leave the cluster: end both loops, the journal writer and the leadership. Each
        step is bounded (a loop that lost its cancellation is logged and left behind):
        a stop never hangs."""
        self._stopping = True
        self.tail.stopping = True  # (the loops also end on these flags)
        for t, what in ((self._campaign, "election"), (self._follower, "journal tail")):
            await cancel_and_wait(t, f"HA {what} loop of {self.advertise}")
        if self.journal is not None:
            await self.journal.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.election.resign(), STOP_TIMEOUT_S)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.md.close(), STOP_TIMEOUT_S)

    # -- request gate --------------------------------------------------------------------

    @property
    def leading(self) -> bool:
        return self.role == "leader" and self.election.valid() and self.journal is not None \
            and self.journal.failed is None

    async def leader_address(self) -> str | None:
        """The current leader's ``host:port`` (cached a quarter second)."""
        if self.leading:
            return self.advertise
        at, addr = self._leader_cache
        if time.monotonic() - at > 0.25:
            try:  # bounded: a master cut off from etcd still refuses at once
                kv = await asyncio.wait_for(self.md.get(self.keys.leader), LOOKUP_TIMEOUT_S)
                addr = leader_address(kv.value if kv is not None else None)
            except (MetadataError, TimeoutError):
                addr = None
            if addr == self.advertise:
                addr = None  # our own stale key: we are not serving
            self._leader_cache = (time.monotonic(), addr)
        return addr

    async def gate(self) -> None:
        """Raise the retryable refusal unless this master leads now."""
        if self.leading:
            return
        addr = await self.leader_address()
        raise RpcError(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS.name,
                       f"this master ({self.advertise}) is not the leader; "
                       + (f"the leader is {addr}" if addr else "no leader is elected yet"),
                       {"code": int(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS),
                        "leader": addr or ""})

    def record(self) -> asyncio.Future[int] | None:
        """Queue the core's unjournaled changes; the future of the last queued change
        (``None`` when everything is durable)."""
        j = self.journal
        if j is None or self.role != "leader":
            return None
        ops = take_changes(self.service.core)
        if ops:  # (already failed when the journal is: the caller is refused)
            return j.append(ops)
        return j.pending()

    async def durable(self, fut: asyncio.Future[int]) -> None:
        """Wait for ``fut``; a failed journal write is the retryable refusal."""
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failed journal write: not durable
            raise RpcError(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS.name,
                           f"this master lost the leadership before the change was durable "
                           f"({e}); retry with the new leader",
                           {"code": int(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS),
                            "leader": ""}) from None

    def status(self) -> dict[str, Any]:
        """Role, journal position (``applied_seq`` of ``head``, ``snapshot_seq``) and the
        health of the background loops (``candidate``: the election loop runs, so this
        master campaigns whenever nobody leads; ``follower_alive``: the journal tail
        runs, or this master leads)."""
        leading = self.leading
        tail = self._follower is not None and not self._follower.done()
        return {"role": "leader" if leading else "follower", "addr": self.advertise,
                "applied_seq": self.index.applied_seq,
                "head": max(self.tail.head, self.index.applied_seq),
                "snapshot_seq": self.journal.snapshot_seq if self.journal is not None
                else self.tail.snap.seq, "revision": self.election.revision,
                "skipped": len(self.index.skipped),
                "candidate": self._campaign is not None and not self._campaign.done(),
                "follower_alive": tail or leading,
                "last_error": self.last_error or self.tail.last_error}

    # -- following -----------------------------------------------------------------------

    # -- leading -------------------------------------------------------------------------

    async def _run(self, after_error: bool = False) -> None:
        if after_error:  # (a loop that ended half-way may have left leadership behind)
            await self._step_down("error")
        while not self._stopping:  # (also ends a loop whose cancellation was lost)
            try:
                await self.election.campaign()
                if await self._promote():
                    reason = await self._lead()
                else:
                    reason = "promotion_refused"
                await self._step_down(reason)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - etcd unreachable: retry, never die
                if isinstance(e, MetadataError):
                    logger.warning("HA loop: %r; campaigning again", e)
                else:
                    self.last_error = f"election loop: {e!r}"
                    logger.exception("HA loop failed; campaigning again")
                await self._step_down("error")
                await asyncio.sleep(0.5)

    async def _promote(self) -> bool:
        t0 = time.monotonic()
        if self._follower is not None:  # the index is ours now
            follower, self._follower = self._follower, None
            follower.cancel()
            await asyncio.wait([follower])  # (our own cancellation still goes through)
        deadline = t0 + self.cfg.catch_up_timeout_s
        while not await self.tail.catch_up():
            if time.monotonic() > deadline or not self.election.valid():
                M_GAPS.inc()
                logger.error("journal entry %d is missing: refusing to lead with an "
                             "incomplete index", self.index.applied_seq + 1)
                return False
            await asyncio.sleep(0.1)
        if not self.election.valid():
            logger.warning("the lease ran out while catching up to entry %d: not leading",
                           self.index.applied_seq)
            return False
        core = MasterCore(self.service.config)
        # in a thread: restoring a large index takes longer than a lease, and a blocked
        # loop keeps no lease alive (each candidate then lost it in turn, and none led)
        report = await asyncio.to_thread(restore, self.index, core, self.service.now_ms())
        for key, reason in report.dropped:
            M_SKIPPED.labels(reason).inc()
            logger.warning("restore dropped %r: %s", key, reason)
        core.objects.changed = set()
        core.segments_changed = set()
        self.journal = JournalWriter(self.md, self.keys, int(self.election.revision or 0),
                                     self.index, self.cfg, self.tail.snap.seq,
                                     self.tail.snap.chunks, self.tail.snap.trim_from,
                                     self.tail.count_skips)
        ops = [["del", k] for k, _ in report.dropped]
        ops += [["del", k] for k in report.discarded_writes]
        self.service.install_core(core)
        self.role = "leader"
        if ops:  # the decision is durable before anybody is served
            try:
                await self.journal.append(ops)
            except (Fenced, MetadataError, LogGap):
                return False
        self.restore_report = report
        M_LEADER.set(1)
        M_PROMOTIONS.inc()
        elapsed = time.monotonic() - t0
        M_RESTORE_S.set(elapsed)
        logger.info("leading as %s: %d objects, %d segments restored at entry %d in %.3f s "
                    "(%d dropped, %d unfinished writes discarded)", self.advertise,
                    report.objects, report.segments, self.index.applied_seq, elapsed,
                    len(report.dropped), len(report.discarded_writes))
        return True

    async def _lead(self) -> str:
        """Return (with the reason) when leadership is lost or unsafe."""
        assert self.journal is not None
        while True:
            if self.journal.failed is not None:
                return "fenced"
            if not self.election.valid():
                return "lease"
            if self._stopping:
                return "stop"
            await wait_set(self.journal.failed_event, 0.05)  # (not wait_for: see aio.py)

    async def _step_down(self, reason: str) -> None:
        """Stop leading (if leading) and follow again; never raises, so the election loop
        always goes back to campaigning."""
        was_leader = self.role == "leader"
        self.role = "follower"
        M_LEADER.set(0)
        try:
            if self.journal is not None:
                journal, self.journal = self.journal, None
                await journal.close()
            self.service.install_core(MasterCore(self.service.config))
            with contextlib.suppress(Exception):
                await self.election.resign()
        except Exception:  # noqa: BLE001 - logged; following and campaigning go on
            logger.exception("stepping down (%s) failed half-way", reason)
        finally:
            if was_leader:
                M_STEP_DOWNS.labels(reason).inc()
                logger.warning("stepped down as leader (%s); following from entry %d and "
                               "campaigning again", reason, self.index.applied_seq)
            if not self._stopping and (self._follower is None or self._follower.done()):
                self._start_follower()
        if reason == "promotion_refused":
            await asyncio.sleep(self.cfg.lease_ttl_s)  # let another candidate try
