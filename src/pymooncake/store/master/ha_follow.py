"""An HA follower's tail of the journal in etcd (``store/master/ha.py``).

``JournalTail`` keeps a ``MetaIndex`` equal to the journal up to ``head``: it applies
watched entries as they come, and catches up every second (also when the watch cannot
be opened) by reading the entries it lacks key by key. A follower behind the last
snapshot — the entries it missed were trimmed after it — loads the snapshot and goes on
from there (soak attempt B: a follower stopped applying at entry 5,391 while the head
was 10,472 and the snapshot at 10,001: its catch-up read the whole log in one answer,
larger than gRPC's 4 MiB limit, and failed on every try). ``run()`` never ends on an
error: each is logged (unexpected ones with their traceback) and retried.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from pymooncake.metadata import MetadataError, MetadataStore
from pymooncake.metadata.aio import next_within
from pymooncake.metadata.base import EventKind
from pymooncake.obs import metrics
from pymooncake.obs.logging import init_logger
from pymooncake.store.master.ha_journal import (
    M_HEAD,
    M_SEQ,
    M_SNAPSHOT,
    HaKeys,
    SnapshotPointer,
    read_pointer,
    read_snapshot,
    read_values,
)
from pymooncake.store.master.journal import MetaIndex

logger = init_logger(__name__)

M_SKIPPED = metrics.counter(
    "pymooncake_store_ha_skipped_records_total",
    "Journal records not loaded, by reason (undecodable, malformed, overlap, bad_range, "
    "no_segment)", ["reason"])
M_SNAPSHOT_LOADS = metrics.counter(
    "pymooncake_store_ha_snapshot_loads_total",
    "Times this master loaded a snapshot because the entries it lacked were trimmed")

READ_AHEAD = 256
"""Journal entries a catch-up reads before applying them (bounds its memory)."""
POLL_S = 1.0
"""Catch-up period of the tail (the watch makes it faster when it works)."""


class JournalTail:
    """The journal applied into ``index`` (see the module docstring)."""

    def __init__(self, md: MetadataStore, keys: HaKeys) -> None:
        self.md, self.keys = md, keys
        self.index = MetaIndex()
        self.snap = SnapshotPointer(0, 0, 1)
        """The snapshot in etcd, as last read."""
        self.head = 0
        """The journal head in etcd, as last read (or written by this master)."""
        self.last_error = ""
        self.stopping = False
        """Set by the master's ``stop()``: ``run()`` returns at its next step even if its
        cancellation was lost."""

    def count_skips(self, before: int) -> None:
        for seq, reason, detail in self.index.skipped[before:]:
            M_SKIPPED.labels(reason).inc()
            logger.warning("journal entry %d: record skipped (%s): %s", seq, reason, detail)

    async def catch_up(self) -> bool:
        """Apply every entry up to ``head``; False when one is missing (a gap, or trimmed
        by a snapshot written meanwhile: the next call loads that snapshot). A follower
        behind the last snapshot loads it first: the entries up to it may be gone."""
        kv = await self.md.get(self.keys.head)
        head = self.head = int(kv.value) if kv is not None else 0
        M_HEAD.set(head)
        ptr = await read_pointer(self.md, self.keys)
        if ptr is not None:
            self.snap = ptr
            M_SNAPSHOT.set(ptr.seq)
        if head < self.index.applied_seq:  # the cluster's journal was reset
            logger.warning("journal head %d is behind entry %d applied here: the journal "
                           "was reset; reloading it", head, self.index.applied_seq)
            self.index = MetaIndex()
        if head <= self.index.applied_seq:
            return True
        if ptr is not None and ptr.seq > self.index.applied_seq:
            chunks = await read_snapshot(self.md, self.keys, ptr)
            if chunks is None:
                return False  # replaced by a newer snapshot meanwhile
            before, behind = len(self.index.skipped), self.index.applied_seq
            self.index.load_snapshot(ptr.seq, chunks)
            self.count_skips(before)
            M_SNAPSHOT_LOADS.inc()
            logger.info("loaded journal snapshot %d (%d chunks; entry %d was applied "
                        "here, the head is %d)", ptr.seq, ptr.chunks, behind, head)
        while self.index.applied_seq < head:
            first = self.index.applied_seq + 1
            seqs = list(range(first, min(head, first + READ_AHEAD - 1) + 1))
            values = await read_values(self.md, [self.keys.entry(q) for q in seqs])
            for seq, raw in zip(seqs, values, strict=True):
                if raw is None:
                    M_SEQ.set(self.index.applied_seq)
                    return False
                before = len(self.index.skipped)
                self.index.apply(seq, raw)
                self.count_skips(before)
        M_SEQ.set(self.index.applied_seq)
        return True

    async def run(self) -> None:
        """Tail the journal until cancelled (or ``stopping``): watch events, and a catch-up
        every ``POLL_S`` (also when the watch cannot be opened). Never ends on an error."""
        loop = asyncio.get_running_loop()
        watch = None
        try:
            while not self.stopping:
                try:
                    if watch is None:
                        try:
                            watch = await self.md.watch_prefix(self.keys.log)
                        except MetadataError as e:
                            logger.warning("journal watch unavailable (%s); polling", e)
                    await self.catch_up()
                    until = loop.time() + POLL_S
                    while watch is not None and loop.time() < until and not self.stopping:
                        # (not wait_for: on 3.11 it drops a cancellation that arrives with
                        # an event, and this loop then kept its stop() waiting forever)
                        ev = await next_within(watch, until - loop.time())
                        if ev is None:
                            break
                        if ev.kind is EventKind.PUT and not self._apply_event(ev):
                            break  # missed some: catch up
                    if watch is None:
                        await asyncio.sleep(max(0.0, until - loop.time()))
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - never stop following: log, retry
                    if isinstance(e, MetadataError | StopAsyncIteration):
                        logger.warning("journal tail interrupted at entry %d (%r); "
                                       "retrying", self.index.applied_seq, e)
                    else:
                        self.last_error = f"journal tail: {e!r}"
                        logger.exception("journal tail failed at entry %d; retrying",
                                         self.index.applied_seq)
                    if watch is not None:
                        with contextlib.suppress(Exception):
                            await watch.close()
                    watch = None
                    await asyncio.sleep(0.5)
        finally:
            if watch is not None:
                with contextlib.suppress(Exception):
                    await watch.close()

    def _apply_event(self, ev: Any) -> bool:
        """Apply a watched entry when it is the next one; False when entries were missed."""
        seq = int(ev.key[len(self.keys.log):])
        if seq == self.index.applied_seq + 1:
            before = len(self.index.skipped)
            self.index.apply(seq, ev.value)
            self.count_skips(before)
            M_SEQ.set(seq)
            self.head = max(self.head, seq)
        return seq <= self.index.applied_seq
