"""One ``get_replica``: pull every shard from the swarm, verify it, advertise it at once.

``parallel`` worker threads each loop: choose (shard, holder) with ``policy.choose`` under
one lock, READ the shard with the Transfer Engine straight into the destination memory,
check its BLAKE3, then mark it held and publish this peer's holder record (others may pull
it from here before this pull finishes). A refresher thread re-reads the holder records
every ``refresh_s`` and checks that the manifest still exists.

Failures: a transfer that fails excludes that holder for ``retry_backoff_s`` (a killed
holder refuses connections at once; its record disappears when its lease lapses); a shard
whose bytes fail the checksum is never advertised and that (shard, holder) pair is never
tried again. When no shard has completed for ``stall_timeout_s`` and no missing shard has
an eligible holder, the pull ends with :class:`NoHolderError`.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import blake3

from pymooncake.metadata import MetadataError
from pymooncake.obs.logging import init_logger
from pymooncake.p2p.manifest import (
    Holder,
    Manifest,
    NoHolderError,
    P2PError,
    P2PNotFound,
    holders_prefix,
    manifest_key,
)
from pymooncake.p2p.policy import choose, fetchers, holder_loads
from pymooncake.transfer import TransferOp, TransferRequest

logger = init_logger(__name__)


MAX_PARALLEL = 64
"""Most shards one peer pulls at once (``PullOptions.parallel``): each is a worker thread,
and past a few per holder more threads only add start-up and contention (the issue-19
report: ``--parallel 100000`` took 12.8 s for 5 shards, the default 8 took 0.10 s)."""


@dataclass(slots=True)
class PullOptions:
    parallel: int = 8
    """Shards pulled at once by this peer (1..``MAX_PARALLEL``)."""
    per_holder: int = 2
    """Most shards this peer pulls at once from one holder."""
    stall_timeout_s: float = 10.0
    """Give up (NoHolderError) after this long without a verified shard and no holder."""
    retry_backoff_s: float = 1.0
    """A holder whose transfer failed is not asked again for this long."""
    refresh_s: float = 0.2
    """How often holder records are re-read."""
    max_rate: float | None = None
    """Bytes per second this pull may start (None: unlimited)."""
    share: bool = True
    """Advertise each verified shard (False: a leecher that serves nobody)."""
    seed: int | None = None
    """Seed of the shard/holder tie-breaking RNG (None: random)."""


@dataclass(frozen=True, slots=True)
class _Job:
    shard: int
    holder: Holder
    start_at: float
    """Monotonic time before which the pull may not start (``max_rate``)."""


@dataclass(slots=True)
class PullStats:
    seconds: float = 0.0
    bytes: int = 0
    shards: int = 0
    bytes_from: dict[str, int] = field(default_factory=dict)
    """Holder segment → bytes pulled from it (verified)."""
    checksum_failures: int = 0
    transfer_failures: int = 0
    started_at: float = 0.0
    """Wall clock (``time.time()``) at the start of the pull."""
    finished_at: float = 0.0


class Puller:
    """Pull ``manifest``'s shards into memory registered at ``addrs`` (one per entry)."""

    def __init__(self, *, engine: Any, metadata: Any, run: Callable[[Any], Any], segment: str,
                 manifest: Manifest, record: Holder, views: list[memoryview],
                 addrs: list[int], publish: Callable[[], None], opts: PullOptions) -> None:
        self.engine, self.metadata, self.run, self.segment = engine, metadata, run, segment
        self.manifest, self.record, self.views, self.addrs = manifest, record, views, addrs
        self.publish, self.opts = publish, opts
        self.cond = threading.Condition()
        self.rng = random.Random(opts.seed)
        self.missing = {s.index for s in manifest.shards}
        self.inflight: dict[int, str] = {}
        self.own: Counter[str] = Counter()
        self.excluded: dict[str, float] = {}
        self.bad: set[tuple[int, str]] = set()
        self.holders: dict[str, Holder] = {}
        self.error: BaseException | None = None
        self.stats = PullStats()
        self.last_progress = time.monotonic()
        self.rate_next = 0.0
        self.stop = threading.Event()

    # ------------------------------------------------------------------ driver
    def run_pull(self) -> PullStats:
        """Pull everything; raises :class:`NoHolderError`, :class:`P2PNotFound` (the
        payload was unregistered meanwhile) or :class:`P2PError`."""
        self.stats.started_at = time.time()
        t0 = time.monotonic()
        self.last_progress = t0
        self.rate_next = t0
        self._refresh()
        refresher = threading.Thread(target=self._refresher, daemon=True, name="p2p-refresh")
        refresher.start()
        workers = [threading.Thread(target=self._worker, daemon=True, name=f"p2p-pull-{i}")
                   for i in range(self.opts.parallel)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        self.stop.set()
        refresher.join()
        if self.error is None and self.missing:     # never a short "success"
            self.error = P2PError(f"payload {self.manifest.name!r}: the pull workers ended "
                                  f"with shards {sorted(self.missing)} missing")
        self.stats.seconds = time.monotonic() - t0
        self.stats.finished_at = time.time()
        if self.error is not None:
            raise self.error
        return self.stats

    def _refresher(self) -> None:
        n = 0
        while not self.stop.wait(self.opts.refresh_s):
            n += 1
            try:
                self._refresh(check_manifest=n % 5 == 0)
            except Exception as e:      # noqa: BLE001 - a metadata hiccup: keep the last view
                logger.warning("p2p: cannot refresh holders of %s: %s", self.manifest.name, e)

    def _refresh(self, check_manifest: bool = False) -> None:
        m = self.manifest
        kvs = self.run(self.metadata.get_prefix(holders_prefix(m.name)))
        holders = {}
        for kv in kvs:
            try:
                h = Holder.decode(kv.value)
            except ValueError:
                continue
            if (h.segment != self.segment and h.manifest_id == m.manifest_id
                    and len(h.bases) == len(m.entries)):
                holders[h.segment] = h
        gone = None
        if check_manifest:
            kv = self.run(self.metadata.get(manifest_key(m.name)))
            if kv is None or m.manifest_id.encode() not in kv.value:
                gone = P2PNotFound(f"payload {m.name!r} was unregistered during the pull")
        with self.cond:
            self.holders = holders
            if gone is not None and self.error is None:
                self.error = gone
            self.cond.notify_all()

    # ------------------------------------------------------------------ workers
    def _pick(self, now: float) -> tuple[int, str] | None:
        excluded = {s for s, t in self.excluded.items() if t > now}
        excluded |= {s for s, n in self.own.items() if n >= self.opts.per_holder}
        todo = self.missing.difference(self.inflight)
        load = holder_loads(self.holders, self.own, self.segment)
        return choose(todo, self.holders, load, excluded, self.bad, self.rng,
                      fetchers(self.holders))

    def _stalled_error(self) -> NoHolderError:
        todo = sorted(self.missing)
        held_by = Counter(s for h in self.holders.values() for s in todo if h.has(s))
        orphans = [s for s in todo if held_by[s] == 0]
        why = (f"{len(orphans)} of them held by nobody" if orphans
               else "every holder of them failed or served bytes that failed the checksum")
        return NoHolderError(
            f"payload {self.manifest.name!r}: no holder could serve {len(todo)} of "
            f"{len(self.manifest.shards)} shards for {self.opts.stall_timeout_s:g} s "
            f"({why}; holders seen: {len(self.holders)})", todo)

    def _next_locked(self, block: bool) -> _Job | None:
        """Under ``self.cond``: the next pull, marked in flight; ``None`` when the pull is
        over (or, with ``block=False``, when nothing can be pulled right now)."""
        while True:
            if self.error is not None or not self.missing:
                return None
            now = time.monotonic()
            pick = self._pick(now)
            if pick is not None:
                break
            if not block:
                return None
            if not self.inflight and now - self.last_progress > self.opts.stall_timeout_s:
                self.error = self._stalled_error()
                self.cond.notify_all()
                return None
            self.cond.wait(0.1)
        shard, seg = pick
        self.inflight[shard] = seg
        self.own[seg] += 1
        self.record.fetching = sorted(self.inflight)
        self.record.pulling = dict(self.own)
        start_at = self.rate_next
        if self.opts.max_rate:
            size = self.manifest.shards[shard].size
            self.rate_next = max(now, self.rate_next) + size / self.opts.max_rate
        return _Job(shard, self.holders[seg], start_at)

    def _worker(self) -> None:
        try:
            self._work()
        except BaseException as e:      # a bug: the pull fails, never "succeeds" short
            logger.error("p2p: a pull worker of %s failed", self.manifest.name, exc_info=True)
            with self.cond:
                if self.error is None:
                    self.error = P2PError(f"a pull worker failed: {e!r}")
                self.cond.notify_all()

    def _work(self) -> None:
        job: _Job | None = None
        while True:
            if job is None:
                with self.cond:
                    job = self._next_locked(block=True)
                if job is None:
                    return
            # One read of the clock: a thread preempted between a check and a second
            # read slept a negative time (ValueError killed it, a shard stayed missing).
            wait_s = job.start_at - time.monotonic() if self.opts.max_rate else 0.0
            if wait_s > 0:
                time.sleep(wait_s)
            try:
                failure = self._pull_one(job.shard, job.holder)
            except Exception as e:      # noqa: BLE001 - a bug must end the pull, not hang it
                logger.error("p2p: pulling shard %d failed unexpectedly", job.shard,
                             exc_info=True)
                failure = ("error", repr(e))
                with self.cond:
                    self.error = P2PError(f"pulling shard {job.shard} from "
                                          f"{job.holder.segment}: {e!r}")
            job = self._done(job, failure)

    def _pull_one(self, shard: int, holder: Holder) -> tuple[str, str] | None:
        s = self.manifest.shards[shard]
        req = TransferRequest(TransferOp.READ, self.addrs[s.entry] + s.offset, holder.segment,
                              holder.bases[s.entry] + s.offset, s.size)
        st = self.engine.batch_transfer_sync([req])[0]
        if not st.ok:
            return "transfer", f"{st.code.value}: {st.reason}"
        digest = blake3.blake3(self.views[s.entry][s.offset:s.offset + s.size]).hexdigest()
        if digest != s.blake3:
            return "checksum", f"BLAKE3 {digest[:16]}… != {s.blake3[:16]}…"
        return None

    def _done(self, job: _Job, failure: tuple[str, str] | None) -> _Job | None:
        """Record the outcome; after a success pick the next pull at once (so the record
        advertising the new shard also says what this peer fetches now) and publish."""
        shard, seg, size = job.shard, job.holder.segment, self.manifest.shards[job.shard].size
        nxt = None
        with self.cond:
            del self.inflight[shard]
            self.own[seg] -= 1
            if self.own[seg] <= 0:
                del self.own[seg]
            if failure is None:
                self.missing.discard(shard)
                self.record.have |= 1 << shard
                self.record.pulling = dict(self.own)
                self.record.fetching = sorted(self.inflight)
                self.stats.bytes += size
                self.stats.shards += 1
                self.stats.bytes_from[seg] = self.stats.bytes_from.get(seg, 0) + size
                self.last_progress = time.monotonic()
                nxt = self._next_locked(block=False)
            elif failure[0] == "checksum":
                self.stats.checksum_failures += 1
                self.bad.add((shard, seg))
                logger.warning("p2p: shard %d of %s from %s failed the checksum (%s); "
                               "pulling it elsewhere", shard, self.manifest.name, seg,
                               failure[1])
            elif failure[0] == "transfer":
                self.stats.transfer_failures += 1
                self.excluded[seg] = time.monotonic() + self.opts.retry_backoff_s
                logger.info("p2p: shard %d of %s from %s failed (%s); holder excluded for "
                            "%g s", shard, self.manifest.name, seg, failure[1],
                            self.opts.retry_backoff_s)
            self.cond.notify_all()
        if failure is None and self.opts.share:
            try:
                self.publish()
            except (MetadataError, TimeoutError) as e:
                logger.warning("p2p: cannot advertise shard %d of %s: %s", shard,
                               self.manifest.name, e)
        return nxt
