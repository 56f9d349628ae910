"""SSD tier: objects spilled from DRAM into files under one directory, LRU-bounded.

Each object is one file named by the BLAKE3 hash of its key (so a derived name is 40 hex
digits: never ``/``, ``..`` or NUL, whatever the key holds). The file carries its own
header — magic, key, payload length and a BLAKE3 digest of key and payload — so a file
is checked on every read: a flipped or missing byte is ``SsdCorrupt`` (the store answers
``CHECKSUM_MISMATCH``/``INTEGRITY_ERROR`` or ``OBJECT_NOT_FOUND``), never data (BUG-60).

Writes are crash-ordered (BUG-61): the file is created under a fresh temporary name with
``O_CREAT|O_EXCL`` (creation never truncates an existing file, BUG-29), written, fsynced,
renamed into place, and the directory is fsynced. A crash therefore leaves either the old
state, a complete object, or an orphan ``*.tmp`` that the next start or ``scan`` removes.
``durable=False`` skips both fsyncs (faster; after a power loss a renamed file may be
torn, which the digest still turns into an error rather than wrong bytes).

One directory has one owner: the tier holds an exclusive ``flock`` on ``.lock`` for its
life, and a second tier on the same directory raises ``SsdDirectoryInUse`` instead of
deleting or overwriting the first one's files (BUG-29). ``SsdTier.claim(root, ...)``
takes the first free ``root/tier-N`` subdirectory, so several storage processes may be
given the same ``--ssd-path``.

The tier holds at most ``capacity_bytes`` of object bytes: with the default
``eviction_policy="lru"`` a write that does not fit first drops the least-recently used
objects (reads refresh recency) and reports them, so the master forgets them; with
``"none"`` such a write is refused (``SsdFull``) and nothing is written (BUG-26).

On start the directory's previous objects are deleted (``recover=False``, the default of
the bare tier); with ``recover=True`` they are re-registered by ``scan()`` (the storage
process does this by default and then re-registers them with the master, issue 17).
``scan()`` rebuilds the index from the directory: it is idempotent (counters are
recomputed, never added to), never follows a symlink, and skips — and reports — anything
that is not a well-formed object file whose header names the key its file name derives
from (BUG-60); ``drop_bad=True`` also deletes the skipped *object* files (damaged or cut
``<40 hex>.obj``; strays of other names are left alone). A verifying scan keeps each
registered object's per-chunk checksum (``store.checksum``) in its report.

``holder()`` is the directory's owner identity: a random id written once (durably) into
``.holder`` by the first tier that owns the directory, so a storage process restarted on
the same directory is recognised as the same holder by the master.

The methods are blocking file I/O and thread-safe; the storage process calls them through
``asyncio.to_thread`` (``aput``/``aget``/``aremove``) so the event loop never blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import itertools
import os
import re
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from pymooncake.store.checksum import digests
from pymooncake.store.tiers.ssd_format import (
    HEADER,
    MAGIC,
    SUFFIX,
    SsdCorrupt,
    file_name,
    read_checked,
    record_digest,
    scan_header,
)

__all__ = ["SSD_EVICTION_POLICIES", "ScanReport", "SsdCorrupt", "SsdDirectoryInUse",
           "SsdFull", "SsdTier", "file_name"]

SSD_EVICTION_POLICIES: tuple[str, ...] = ("lru", "none")
_SUFFIX = SUFFIX
_TMP = ".tmp"
_LOCK = ".lock"
_HOLDER = ".holder"
_HOLDER_ID = re.compile(r"[0-9a-f]{32}")
_NAME_CHARS = frozenset("0123456789abcdef")
_TMP_NAME = re.compile(r"[0-9a-f]{40}\.\d+\.\d+\.tmp")  # this tier's temporary files
_tmp_ids = itertools.count()


class SsdFull(Exception):
    """A write does not fit and the tier's policy forbids eviction (``NO_SPACE``)."""


class SsdDirectoryInUse(Exception):
    """Another live tier holds the directory's lock."""


@dataclass
class ScanReport:
    """What ``scan`` registered and what it skipped (``(entry name, reason)``)."""

    registered: int = 0
    used_bytes: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)
    removed_tmp: int = 0
    removed_bad: int = 0
    checksums: dict[str, bytes] = field(default_factory=dict)
    """key → per-chunk checksum of its payload (``store.checksum.digests``), verify only."""


class SsdTier:
    """Spill files under ``path``, at most ``capacity_bytes`` of object bytes in total.

    ``put(key, data)`` → keys evicted to make room (oldest first); raises ``SsdFull`` when
    ``data`` is larger than the tier or the policy is ``"none"`` and it does not fit, and
    ``ValueError`` for an empty key. ``get(key)`` → the exact bytes, or ``None`` when
    absent; ``SsdCorrupt`` (and the file is dropped) when the bytes on disk fail their
    checksum. Never returns partial or wrong bytes.
    """

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int,
                 eviction_policy: str = "lru", *, recover: bool = False,
                 durable: bool = True, drop_bad: bool = False) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes={capacity_bytes}: must be > 0 "
                             "(pass --ssd-capacity BYTES)")
        if eviction_policy not in SSD_EVICTION_POLICIES:
            raise ValueError(f"eviction_policy={eviction_policy!r}: choose one of "
                             f"{', '.join(SSD_EVICTION_POLICIES)}")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.eviction_policy = eviction_policy
        self.durable = durable
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> size, LRU first
        self._lock = threading.Lock()
        self.used_bytes = 0
        self.num_evictions = 0
        self.num_corrupt = 0
        self._lock_fd = self._take_lock()
        try:
            if recover:
                self.last_scan = self.scan(drop_bad=drop_bad)
            else:
                self.last_scan = ScanReport()
                for entry in os.scandir(self.path):
                    if entry.is_file(follow_symlinks=False) and (
                            entry.name.endswith(_SUFFIX) or _TMP_NAME.fullmatch(entry.name)):
                        os.unlink(entry.path)
        except BaseException:
            self.close()
            raise

    @classmethod
    def claim(cls, root: str | os.PathLike[str], capacity_bytes: int,
              eviction_policy: str = "lru", *, max_tiers: int = 256,
              **kw: bool) -> SsdTier:
        """A tier in the first ``root/tier-N`` no live tier holds (several processes may
        share one ``--ssd-path``; each gets its own subdirectory)."""
        for n in range(max_tiers):
            try:
                return cls(Path(root) / f"tier-{n}", capacity_bytes, eviction_policy, **kw)
            except SsdDirectoryInUse:
                continue
        raise SsdDirectoryInUse(f"{root}: all {max_tiers} tier directories are in use")

    def holder(self) -> str:
        """This directory's holder id (32 hex digits): read from ``.holder``, or made and
        written durably (temporary file, fsync, rename, directory fsync) when absent."""
        p = self.path / _HOLDER
        with contextlib.suppress(FileNotFoundError, UnicodeDecodeError):
            text = p.read_text().strip()
            if _HOLDER_ID.fullmatch(text):
                return text
        hid = uuid.uuid4().hex
        tmp = self.path / f"{_HOLDER}.{os.getpid()}.{next(_tmp_ids)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(hid + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
        self._fsync_dir()
        return hid

    def _take_lock(self) -> int:
        fd = os.open(self.path / _LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SsdDirectoryInUse(f"SSD directory {self.path} is owned by another live "
                                    "store process") from None
        return fd

    def close(self) -> None:
        """Release the directory (files stay)."""
        fd, self._lock_fd = getattr(self, "_lock_fd", -1), -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def _file(self, key: str) -> Path:
        name = file_name(key)
        # containment: a derived name is a plain entry of this directory, nothing else
        if "/" in name or "\0" in name or name.startswith(".."):
            raise ValueError(f"key {key!r} derives an unsafe file name")
        return self.path / name

    # -- write ---------------------------------------------------------------------------

    def _fsync_dir(self) -> None:
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _write_file(self, key: str, data: bytes | memoryview) -> None:
        kb = key.encode("utf-8", "surrogatepass")
        final = self._file(key)
        tmp = self.path / f"{final.stem}.{os.getpid()}.{next(_tmp_ids)}{_TMP}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(HEADER.pack(MAGIC, len(kb), len(data), record_digest(kb, data)))
                f.write(kb)
                f.write(data)
                f.flush()
                if self.durable:
                    os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        if self.durable:
            self._fsync_dir()

    def put(self, key: str, data: bytes | memoryview) -> list[str]:
        if not key:
            raise ValueError("empty key")
        size = len(data)
        if size > self.capacity_bytes:
            raise SsdFull(f"object of {size} bytes exceeds SSD capacity {self.capacity_bytes}")
        evicted: list[str] = []
        with self._lock:
            if key in self._index:
                self._drop(key)
            if self.used_bytes + size > self.capacity_bytes:
                if self.eviction_policy == "none":
                    raise SsdFull(f"SSD tier full ({self.used_bytes}/{self.capacity_bytes} "
                                  f"bytes) and eviction_policy='none'")
                while self.used_bytes + size > self.capacity_bytes and self._index:
                    old = next(iter(self._index))
                    self._drop(old)
                    evicted.append(old)
                    self.num_evictions += 1
            self._write_file(key, data)
            self._index[key] = size
            self.used_bytes += size
        return evicted

    def _drop(self, key: str) -> None:
        size = self._index.pop(key)
        self.used_bytes -= size
        with contextlib.suppress(FileNotFoundError):
            self._file(key).unlink()

    # -- read ----------------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        with self._lock:
            size = self._index.get(key)
            if size is None:
                return None
            self._index.move_to_end(key)
            try:
                _, data = read_checked(self._file(key), key, size)
            except FileNotFoundError:
                self._drop(key)
                return None
            except SsdCorrupt:
                self._drop(key)
                self.num_corrupt += 1
                raise
            return data

    def remove(self, key: str) -> bool:
        with self._lock:
            if key not in self._index:
                return False
            self._drop(key)
            return True

    def clear(self) -> None:
        with self._lock:
            for key in list(self._index):
                self._drop(key)

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._index)

    def sizes(self) -> dict[str, int]:
        """key → payload bytes of every indexed object."""
        with self._lock:
            return dict(self._index)

    # -- recovery ------------------------------------------------------------------------

    def scan(self, verify: bool = True, drop_bad: bool = False) -> ScanReport:
        """Rebuild the index from the directory (see module docstring). Idempotent; never
        raises for a bad entry, never follows a symlink; this tier's orphan temporary
        files (a crash before their rename) are removed, any other stray entry is left
        alone and reported. ``verify`` also checks every payload's digest (reads every
        byte; the report then carries each object's per-chunk checksum); without it
        damaged payloads are found on ``get``. ``drop_bad``: delete the object files that
        fail (counted in ``removed_bad``), so a later scan does not meet them again."""
        rep = ScanReport()
        index: OrderedDict[str, int] = OrderedDict()
        with self._lock:
            entries = sorted(os.scandir(self.path), key=lambda e: e.name)
            for e in entries:
                if e.name in (_LOCK, _HOLDER):
                    continue
                if e.is_symlink() or not e.is_file(follow_symlinks=False):
                    rep.skipped.append((e.name, "not a regular file"))
                    continue
                if _TMP_NAME.fullmatch(e.name):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(e.path)
                    rep.removed_tmp += 1
                    continue
                stem = e.name[:-len(_SUFFIX)] if e.name.endswith(_SUFFIX) else ""
                if len(stem) != 40 or not set(stem) <= _NAME_CHARS:
                    rep.skipped.append((e.name, "not an object file"))
                    continue
                try:
                    key, size = scan_header(Path(e.path))
                    if verify:
                        _, data = read_checked(Path(e.path), key, size)
                        rep.checksums[key] = digests(data)
                except (SsdCorrupt, OSError) as err:
                    rep.skipped.append((e.name, str(err)))
                    if drop_bad:
                        with contextlib.suppress(OSError):
                            os.unlink(e.path)
                            rep.removed_bad += 1
                    continue
                index[key] = size
            self._index = index
            self.used_bytes = sum(index.values())
            rep.registered, rep.used_bytes = len(index), self.used_bytes
        self.last_scan = rep
        return rep

    # -- async wrappers ------------------------------------------------------------------

    async def aput(self, key: str, data: bytes | memoryview) -> list[str]:
        return await asyncio.to_thread(self.put, key, data)

    async def aget(self, key: str) -> bytes | None:
        return await asyncio.to_thread(self.get, key)

    async def aremove(self, key: str) -> bool:
        return await asyncio.to_thread(self.remove, key)
