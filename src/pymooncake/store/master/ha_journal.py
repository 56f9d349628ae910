"""HA journal plumbing: settings, etcd keys, the leader's fenced writer, bounded readers.

``store/master/ha.py`` (``HaController``) runs the election and the follower; this module
holds what it writes and reads in etcd (key layout in ``ha.py``'s docstring). Reads of
the journal and of a snapshot go key by key in bounded concurrent batches: one range read
of the whole log grew past gRPC's 4 MiB answer limit under load and then failed on every
try, so a follower that fell behind never caught up again (soak attempt B).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import msgpack

from pymooncake.metadata import MetadataError, MetadataStore
from pymooncake.metadata.aio import cancel_and_wait
from pymooncake.obs import metrics
from pymooncake.obs.logging import init_logger
from pymooncake.store.master.journal import LogGap, MetaIndex, encode_entry

logger = init_logger(__name__)

M_SEQ = metrics.gauge("pymooncake_store_ha_journal_seq", "Last journal entry applied here")
M_HEAD = metrics.gauge("pymooncake_store_ha_journal_head",
                       "Last journal entry in etcd, as this master last read or wrote it")
M_SNAPSHOT = metrics.gauge("pymooncake_store_ha_snapshot_seq",
                           "Entry of the last snapshot in etcd, as this master last saw it")

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
        if not (self.lease_ttl_s >= 1.0 and float(self.lease_ttl_s).is_integer()):
            raise ValueError(f"lease_ttl_s={self.lease_ttl_s}: must be whole seconds >= 1 "
                             "(etcd leases are whole seconds)")
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


class JournalWriter:
    """The leader's ordered, fenced, group-committed writer (one entry in flight)."""

    def __init__(self, md: MetadataStore, keys: HaKeys, guard: int, index: MetaIndex,
                 cfg: HaConfig, snap_seq: int, snap_chunks: int, trim_from: int,
                 on_skip: Any) -> None:
        self.md, self.keys, self.guard, self.index, self.cfg = md, keys, guard, index, cfg
        self._items: list[tuple[list[Any], int, asyncio.Future[int] | None]] = []
        self._inflight: list[tuple[list[Any], int, asyncio.Future[int] | None]] = []
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

    @property
    def snapshot_seq(self) -> int:
        """Entry of the last snapshot in etcd (as this writer knows it)."""
        return self._snap_seq

    def pending(self) -> asyncio.Future[int] | None:
        """The future of the last change queued, while it is not yet durable."""
        return self._last if self._last is not None and not self._last.done() else None

    def _fail(self, e: BaseException) -> None:
        self.failed = e
        for _, _, fut in [*self._inflight, *self._items]:
            if fut is not None and not fut.done():
                fut.set_exception(e)
                fut.exception()
        self._items.clear()
        self._inflight = []
        self.failed_event.set()

    async def close(self) -> None:
        """Stop writing (bounded; a cancellation of the caller is not swallowed) and fail
        every change still queued."""
        await cancel_and_wait(self._task, "journal writer")
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
                    self._inflight = batch  # (failed too if this write never ends)
                    ops = [op for part, _, _ in batch for op in part]
                    seq = self.index.applied_seq + 1
                    raw = encode_entry(seq, ops)
                    await self._write([(self.keys.entry(seq), raw),
                                       (self.keys.head, str(seq).encode())])
                    before = len(self.index.skipped)
                    self.index.apply(seq, raw)
                    self._on_skip(before)
                    M_SEQ.set(seq)
                    M_HEAD.set(seq)
                    for _, _, fut in batch:
                        if fut is not None and not fut.done():
                            fut.set_result(seq)
                    self._inflight = []
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
        chunks = await asyncio.to_thread(self.index.snapshot_chunks)  # (loop stays live)
        for i, c in enumerate(chunks):
            await self._write([(self.keys.snap_chunk(seq, i), c)])
        await self._write([(self.keys.snapshot, msgpack.packb(
            {"seq": seq, "chunks": len(chunks), "from": self._trim_from}))])
        old = [self.keys.entry(s) for s in range(self._trim_from, seq + 1)]
        old += [self.keys.snap_chunk(self._snap_seq, i) for i in range(self._snap_chunks)]
        for i in range(0, len(old), TXN_DELETES):
            await self._write([], old[i:i + TXN_DELETES])
        self._snap_seq, self._snap_chunks, self._trim_from = seq, len(chunks), seq + 1
        M_SNAPSHOT.set(seq)
        logger.info("journal snapshot at entry %d (%d chunks, %d objects)", seq, len(chunks),
                    len(self.index.objects))




READ_BATCH = 32
"""Keys read at once by a catch-up (each at most one ~512 KiB entry or snapshot chunk)."""


async def read_values(md: MetadataStore, keys: list[str]) -> list[bytes | None]:
    """The values of ``keys`` in order (``None`` where absent), ``READ_BATCH`` concurrent
    single-key reads at a time, so no answer approaches a transport's size limit."""
    out: list[bytes | None] = []
    for i in range(0, len(keys), READ_BATCH):
        kvs = await asyncio.gather(*(md.get(k) for k in keys[i:i + READ_BATCH]))
        out += [kv.value if kv is not None else None for kv in kvs]
    return out


@dataclass(frozen=True, slots=True)
class SnapshotPointer:
    """The ``snapshot`` key: entry ``seq``, its ``chunks``, and ``trim_from``, the first log
    entry its writer was trimming (entries ``trim_from..seq`` are, or are being, deleted)."""

    seq: int
    chunks: int
    trim_from: int

    @classmethod
    def decode(cls, raw: bytes) -> SnapshotPointer:
        """Raises ``ValueError`` naming what is wrong with a pointer that does not decode."""
        try:
            d = msgpack.unpackb(raw, raw=False)
            seq, chunks = int(d["seq"]), int(d["chunks"])
            return cls(seq, chunks, int(d.get("from", seq + 1)))
        except Exception as e:  # noqa: BLE001 - any bad pointer: one clear error
            raise ValueError(f"snapshot pointer {raw[:60]!r} does not decode: {e!r}") from None


async def read_pointer(md: MetadataStore, keys: HaKeys) -> SnapshotPointer | None:
    kv = await md.get(keys.snapshot)
    return SnapshotPointer.decode(kv.value) if kv is not None else None


async def read_snapshot(md: MetadataStore, keys: HaKeys,
                        ptr: SnapshotPointer) -> list[bytes] | None:
    """The chunks of snapshot ``ptr`` in order; ``None`` when one is missing (a newer
    snapshot replaced it meanwhile: read the pointer again)."""
    chunks = await read_values(md, [keys.snap_chunk(ptr.seq, i) for i in range(ptr.chunks)])
    if any(c is None for c in chunks):
        return None
    return [c for c in chunks if c is not None]
