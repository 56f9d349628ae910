"""Master high availability on etcd: leader election, a fenced journal, warm followers.

Several ``pymooncake master --ha`` processes share one metadata service (etcd). Keys, under
``pymooncake/store/<cluster_id>/``:

* ``leader`` — the elected master (``metadata.election``), value msgpack
  ``{"addr": "host:port", "id": ...}``, on the leader's lease (``lease_ttl_s``);
* ``log/<seq>`` — journal entries (``store/master/journal.py``), ``head`` — the last seq;
* ``snapshot`` — ``{"seq": S, "chunks": n}`` of the last complete snapshot, whose chunks
  are ``snap/<S>/<i>``; entries up to ``S`` are deleted once it is written.

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
(etcd watch, and a catch-up read every second) into a ``MetaIndex``, so promotion only
reads what is new. On winning the election a follower first reads up to ``head`` (a
missing entry is waited for at most ``catch_up_timeout_s``; then it refuses to lead:
``UNAVAILABLE``, leadership released — never a partial index), restores a core from the
index, journals the objects it refused (bad or overlapping records), and only then
answers its first request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack

from pymooncake.metadata import MetadataError, MetadataStore, open_metadata
from pymooncake.metadata.base import EventKind
from pymooncake.metadata.election import LeaderElection
from pymooncake.obs import metrics
from pymooncake.obs.logging import init_logger
from pymooncake.rpc import RpcError
from pymooncake.store.errors import ErrorCode
from pymooncake.store.master.core import MasterCore
from pymooncake.store.master.journal import (
    LogGap,
    MetaIndex,
    encode_entry,
    restore,
    take_changes,
)

if TYPE_CHECKING:
    from pymooncake.store.master.service import MasterService

logger = init_logger(__name__)

M_LEADER = metrics.gauge("pymooncake_store_ha_is_leader", "1 while this master is the leader")
M_SEQ = metrics.gauge("pymooncake_store_ha_journal_seq", "Last journal entry applied here")
M_SKIPPED = metrics.counter(
    "pymooncake_store_ha_skipped_records_total",
    "Journal records not loaded, by reason (undecodable, malformed, overlap, bad_range, "
    "no_segment)", ["reason"])
M_GAPS = metrics.counter("pymooncake_store_ha_log_gaps_total",
                         "Promotions refused because a journal entry was missing")
M_PROMOTIONS = metrics.counter("pymooncake_store_ha_promotions_total",
                               "Times this master became the leader")
M_STEP_DOWNS = metrics.counter("pymooncake_store_ha_step_downs_total",
                               "Times this master stopped leading, by reason", ["reason"])
M_RESTORE_S = metrics.gauge("pymooncake_store_ha_restore_seconds",
                            "Time of the last promotion: catch-up + restore + journaling (s)")

ENTRY_BYTES = 512 << 10
"""Most operation bytes one journal entry carries (etcd takes requests up to 1.5 MiB)."""
OPS_PER_ITEM = 1000
"""A change set larger than this (an unmount dropping many objects) spans entries."""
LOOKUP_TIMEOUT_S = 0.5
"""Longest a refusal waits for etcd to name the leader (else it names none)."""
TXN_DELETES = 100
"""Keys deleted per transaction when trimming the log after a snapshot."""


@dataclass(frozen=True, slots=True)
class HaConfig:
    """HA settings of one master. ``metadata_url``: ``etcd://host:port`` (any
    ``open_metadata`` URL works; etcd is what survives the masters). Times in seconds.
    Raises ``ValueError`` naming the field when a value is out of range."""

    metadata_url: str
    cluster_id: str = "default"
    lease_ttl_s: float = 2.0
    """The leader's etcd lease; a dead leader is replaced about this long after."""
    snapshot_every: int = 1000
    """Journal entries between snapshots (the log is trimmed after each)."""
    catch_up_timeout_s: float = 2.0
    """Longest a newly elected leader waits for a missing journal entry before refusing."""

    def __post_init__(self) -> None:
        if not isinstance(self.metadata_url, str) or "://" not in self.metadata_url:
            raise ValueError(f"metadata_url={self.metadata_url!r}: expected etcd://host:port")
        if not self.cluster_id or "/" in self.cluster_id:
            raise ValueError(f"cluster_id={self.cluster_id!r}: must be non-empty, no '/'")
        if not self.lease_ttl_s >= 1.0:
            raise ValueError(f"lease_ttl_s={self.lease_ttl_s}: must be >= 1 s (etcd leases "
                             "are whole seconds)")
        if self.snapshot_every < 1:
            raise ValueError(f"snapshot_every={self.snapshot_every}: must be >= 1")
        if not self.catch_up_timeout_s > 0:
            raise ValueError(f"catch_up_timeout_s={self.catch_up_timeout_s}: must be > 0")


@dataclass(frozen=True, slots=True)
class HaKeys:
    """The metadata keys of one cluster (see the module docstring)."""

    root: str

    @classmethod
    def of(cls, cluster_id: str) -> HaKeys:
        return cls(f"pymooncake/store/{cluster_id}/")

    @property
    def leader(self) -> str:
        return self.root + "leader"

    @property
    def head(self) -> str:
        return self.root + "head"

    @property
    def log(self) -> str:
        return self.root + "log/"

    @property
    def snapshot(self) -> str:
        return self.root + "snapshot"

    def entry(self, seq: int) -> str:
        return f"{self.log}{seq:016d}"

    def snap_chunk(self, seq: int, i: int) -> str:
        return f"{self.root}snap/{seq:016d}/{i:06d}"


def leader_address(value: bytes | None) -> str | None:
    """The ``host:port`` in a leader key's value (``None`` when absent or unreadable)."""
    if not value:
        return None
    try:
        d = msgpack.unpackb(value, raw=False)
        return str(d["addr"]) if isinstance(d, dict) and d.get("addr") else None
    except Exception:  # noqa: BLE001 - a foreign value: no address
        return None


class Fenced(Exception):
    """A journal write was refused: this master is no longer the leader."""


class _Journal:
    """The leader's ordered, fenced, group-committed writer (one entry in flight)."""

    def __init__(self, md: MetadataStore, keys: HaKeys, guard: int, index: MetaIndex,
                 cfg: HaConfig, snap_seq: int, snap_chunks: int, trim_from: int,
                 on_skip: Any) -> None:
        self.md, self.keys, self.guard, self.index, self.cfg = md, keys, guard, index, cfg
        self._items: list[tuple[list[Any], int, asyncio.Future[int] | None]] = []
        self._wake = asyncio.Event()
        self.failed: BaseException | None = None
        self.failed_event = asyncio.Event()
        self._snap_seq, self._snap_chunks, self._trim_from = snap_seq, snap_chunks, trim_from
        self._on_skip = on_skip
        self._last: asyncio.Future[int] | None = None
        self._task = asyncio.ensure_future(self._run())

    def append(self, ops: list[Any]) -> asyncio.Future[int]:
        """Queue ``ops``; the future resolves (to the entry's seq) once they are durable,
        or fails with ``Fenced``/``MetadataError``."""
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        if self.failed is not None:
            fut.set_exception(self.failed)
            fut.exception()  # nobody may await it: no "never retrieved" warning
            return fut
        part: list[Any] = []
        size = 0
        for op in ops:  # items of at most OPS_PER_ITEM ops and about ENTRY_BYTES
            n = len(msgpack.packb(op, use_bin_type=True))
            if part and (len(part) >= OPS_PER_ITEM or size + n > ENTRY_BYTES):
                self._items.append((part, size, None))
                part, size = [], 0
            part.append(op)
            size += n
        self._items.append((part, size, fut))
        self._last = fut
        self._wake.set()
        return fut

    def pending(self) -> asyncio.Future[int] | None:
        """The future of the last change queued, while it is not yet durable."""
        return self._last if self._last is not None and not self._last.done() else None

    def _fail(self, e: BaseException) -> None:
        self.failed = e
        for _, _, fut in self._items:
            if fut is not None and not fut.done():
                fut.set_exception(e)
                fut.exception()
        self._items.clear()
        self.failed_event.set()

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        if self.failed is None:
            self._fail(Fenced("the leader stepped down"))

    async def _write(self, puts: list[tuple[str, bytes]], deletes: list[str] = ()) -> None:
        rev = await self.md.guarded_write(self.keys.leader, self.guard, puts, deletes)
        if rev is None:
            raise Fenced("the leader key changed: another master leads")

    async def _run(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._items:
                    n, size = 0, 0
                    while n < len(self._items) and (n == 0 or size + self._items[n][1]
                                                    <= ENTRY_BYTES):
                        size += self._items[n][1]
                        n += 1
                    batch, self._items = self._items[:n], self._items[n:]
                    ops = [op for part, _, _ in batch for op in part]
                    seq = self.index.applied_seq + 1
                    raw = encode_entry(seq, ops)
                    await self._write([(self.keys.entry(seq), raw),
                                       (self.keys.head, str(seq).encode())])
                    before = len(self.index.skipped)
                    self.index.apply(seq, raw)
                    self._on_skip(before)
                    M_SEQ.set(seq)
                    for _, _, fut in batch:
                        if fut is not None and not fut.done():
                            fut.set_result(seq)
                    if seq - self._snap_seq >= self.cfg.snapshot_every and not self._items:
                        await self._snapshot()
        except asyncio.CancelledError:
            raise
        except (Fenced, MetadataError, LogGap) as e:
            logger.warning("journal write failed, stepping down: %s", e)
            self._fail(e)
        except Exception as e:  # noqa: BLE001 - never leave writers waiting forever
            logger.exception("journal writer failed")
            self._fail(e)

    async def _snapshot(self) -> None:
        """Write the index as snapshot ``applied_seq``, then trim the log and the old one."""
        seq = self.index.applied_seq
        chunks = self.index.snapshot_chunks()
        for i, c in enumerate(chunks):
            await self._write([(self.keys.snap_chunk(seq, i), c)])
        await self._write([(self.keys.snapshot,
                            msgpack.packb({"seq": seq, "chunks": len(chunks)}))])
        old = [self.keys.entry(s) for s in range(self._trim_from, seq + 1)]
        old += [self.keys.snap_chunk(self._snap_seq, i) for i in range(self._snap_chunks)]
        for i in range(0, len(old), TXN_DELETES):
            await self._write([], old[i:i + TXN_DELETES])
        self._snap_seq, self._snap_chunks, self._trim_from = seq, len(chunks), seq + 1
        logger.info("journal snapshot at entry %d (%d chunks, %d objects)", seq, len(chunks),
                    len(self.index.objects))


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
        self.index = MetaIndex()
        self.role = "follower"
        self.journal: _Journal | None = None
        self.restore_report: Any = None
        self._leader_cache: tuple[float, str | None] = (float("-inf"), None)
        self._snap: tuple[int, int] = (0, 0)  # (seq, chunks) of the snapshot in etcd
        self._first_entry = 1
        self._tasks: list[asyncio.Task[Any]] = []
        self._follower: asyncio.Task[Any] | None = None

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Join: follow the journal and campaign in the background. Raises
        ``MetadataError`` when the metadata service cannot be reached."""
        await self.md.get(self.keys.head)  # fail fast when etcd is unreachable
        self._follower = asyncio.ensure_future(self._follow())
        self._tasks.append(asyncio.ensure_future(self._run()))

    async def stop(self) -> None:
        for t in [*self._tasks, *([self._follower] if self._follower else [])]:
            t.cancel()
        for t in [*self._tasks, *([self._follower] if self._follower else [])]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.journal is not None:
            await self.journal.close()
        with contextlib.suppress(Exception):
            await self.election.resign()
        with contextlib.suppress(Exception):
            await self.md.close()

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
        return {"role": "leader" if self.leading else "follower", "addr": self.advertise,
                "applied_seq": self.index.applied_seq, "revision": self.election.revision,
                "skipped": len(self.index.skipped)}

    # -- following -----------------------------------------------------------------------

    def _count_skips(self, before: int) -> None:
        for seq, reason, detail in self.index.skipped[before:]:
            M_SKIPPED.labels(reason).inc()
            logger.warning("journal entry %d: record skipped (%s): %s", seq, reason, detail)

    async def catch_up(self) -> bool:
        """Apply every entry up to ``head``; False when one is missing (a gap)."""
        kv = await self.md.get(self.keys.head)
        head = int(kv.value) if kv is not None else 0
        snap_kv = await self.md.get(self.keys.snapshot)
        snap = msgpack.unpackb(snap_kv.value) if snap_kv is not None else None
        if snap is not None:
            self._snap = (int(snap["seq"]), int(snap["chunks"]))
        if head < self.index.applied_seq:  # the cluster's journal was reset
            self.index = MetaIndex()
        if head <= self.index.applied_seq:
            return True
        entries = {int(e.key[len(self.keys.log):]): e.value
                   for e in await self.md.get_prefix(self.keys.log)}
        if entries:
            self._first_entry = min(entries)
        while self.index.applied_seq < head:
            nxt = self.index.applied_seq + 1
            before = len(self.index.skipped)
            if nxt in entries:
                self.index.apply(nxt, entries[nxt])
            elif snap is not None and int(snap["seq"]) >= nxt:
                s = int(snap["seq"])
                chunks = await self.md.get_prefix(self.keys.snap_chunk(s, 0)[:-6])
                self.index.load_snapshot(s, [c.value for c in chunks])
                if len(chunks) != int(snap["chunks"]):
                    self.index.skipped.append((s, "undecodable",
                                               f"snapshot has {len(chunks)} of "
                                               f"{snap['chunks']} chunks"))
                snap = None
            else:
                return False
            self._count_skips(before)
        M_SEQ.set(self.index.applied_seq)
        return True

    async def _follow(self) -> None:
        """Tail the journal while not leading (watch, plus a catch-up every second)."""
        watch = None
        try:
            while True:
                try:
                    if watch is None:
                        watch = await self.md.watch_prefix(self.keys.log)
                        await self.catch_up()
                    try:
                        ev = await asyncio.wait_for(watch.__anext__(), 1.0)
                    except TimeoutError:
                        await self.catch_up()
                        continue
                    if ev.kind is not EventKind.PUT:
                        continue
                    seq = int(ev.key[len(self.keys.log):])
                    if seq == self.index.applied_seq + 1:
                        before = len(self.index.skipped)
                        self.index.apply(seq, ev.value)
                        self._count_skips(before)
                        M_SEQ.set(seq)
                    elif seq > self.index.applied_seq + 1:
                        await self.catch_up()
                except (MetadataError, StopAsyncIteration, ValueError) as e:
                    logger.info("journal tail interrupted (%s); retrying", e)
                    if watch is not None:
                        with contextlib.suppress(Exception):
                            await watch.close()
                    watch = None
                    await asyncio.sleep(0.5)
        finally:
            if watch is not None:
                with contextlib.suppress(Exception):
                    await watch.close()

    # -- leading -------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
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
                logger.warning("HA loop: %r; retrying", e)
                with contextlib.suppress(Exception):
                    await self._step_down("error")
                await asyncio.sleep(0.5)

    async def _promote(self) -> bool:
        t0 = time.monotonic()
        if self._follower is not None:
            self._follower.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._follower
            self._follower = None
        deadline = t0 + self.cfg.catch_up_timeout_s
        while not await self.catch_up():
            if time.monotonic() > deadline or not self.election.valid():
                M_GAPS.inc()
                logger.error("journal entry %d is missing: refusing to lead with an "
                             "incomplete index", self.index.applied_seq + 1)
                return False
            await asyncio.sleep(0.1)
        if not self.election.valid():
            return False
        core = MasterCore(self.service.config)
        report = restore(self.index, core, self.service.now_ms())
        for key, reason in report.dropped:
            M_SKIPPED.labels(reason).inc()
            logger.warning("restore dropped %r: %s", key, reason)
        core.objects.changed = set()
        core.segments_changed = set()
        self.journal = _Journal(self.md, self.keys, int(self.election.revision or 0),
                                self.index, self.cfg, self._snap[0], self._snap[1],
                                max(self._first_entry, self._snap[0] + 1), self._count_skips)
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
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.journal.failed_event.wait(), 0.05)

    async def _step_down(self, reason: str) -> None:
        was_leader = self.role == "leader"
        self.role = "follower"
        M_LEADER.set(0)
        if self.journal is not None:
            await self.journal.close()
            self.journal = None
        self.service.install_core(MasterCore(self.service.config))
        with contextlib.suppress(Exception):
            await self.election.resign()
        if was_leader:
            M_STEP_DOWNS.labels(reason).inc()
            logger.warning("stepped down as leader (%s)", reason)
        if self._follower is None:
            self._follower = asyncio.ensure_future(self._follow())
        if reason == "promotion_refused":
            await asyncio.sleep(self.cfg.lease_ttl_s)  # let another candidate try
