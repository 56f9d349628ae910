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

On start the directory's previous objects are deleted (``recover=False``, the default:
without a master snapshot nobody could name them, docs/store.md, BUG-31); with
``recover=True`` they are re-registered by ``scan()``. ``scan()`` rebuilds the index from
the directory: it is idempotent (counters are recomputed, never added to), never follows
a symlink, and skips — and reports — anything that is not a well-formed object file whose
header names the key its file name derives from (BUG-60).

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
import stat
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import blake3

SSD_EVICTION_POLICIES: tuple[str, ...] = ("lru", "none")
_SUFFIX = ".obj"
_TMP = ".tmp"
_LOCK = ".lock"
_MAGIC = b"PMS1"
_HEADER = struct.Struct("<4sIQ32s")  # magic, key bytes, payload bytes, blake3(key ‖ payload)
_NAME_CHARS = frozenset("0123456789abcdef")
_TMP_NAME = re.compile(r"[0-9a-f]{40}\.\d+\.\d+\.tmp")  # this tier's temporary files
_tmp_ids = itertools.count()


class SsdFull(Exception):
    """A write does not fit and the tier's policy forbids eviction (``NO_SPACE``)."""


class SsdCorrupt(Exception):
    """A stored object failed its checksum or header check (``INTEGRITY_ERROR``)."""


class SsdDirectoryInUse(Exception):
    """Another live tier holds the directory's lock."""


@dataclass
class ScanReport:
    """What ``scan`` registered and what it skipped (``(entry name, reason)``)."""

    registered: int = 0
    used_bytes: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)
    removed_tmp: int = 0


def _digest(key: bytes, data: bytes | memoryview) -> bytes:
    h = blake3.blake3(key)
    h.update(data)
    return h.digest()


def file_name(key: str) -> str:
    """The file name an object of ``key`` is stored under (40 hex digits + ``.obj``)."""
    return blake3.blake3(key.encode("utf-8", "surrogatepass")).hexdigest()[:40] + _SUFFIX


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
                 durable: bool = True) -> None:
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
                self.last_scan = self.scan()
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
                f.write(_HEADER.pack(_MAGIC, len(kb), len(data), _digest(kb, data)))
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

    @staticmethod
    def _read_checked(path: Path, key: str | None, size: int | None) -> tuple[str, bytes]:
        """(key, payload) of an object file; ``SsdCorrupt`` on any mismatch (a symlink is
        never followed: ``O_NOFOLLOW``)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            if isinstance(e, FileNotFoundError):
                raise
            raise SsdCorrupt(f"{path.name}: cannot open ({e.strerror})") from None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise SsdCorrupt(f"{path.name}: not a regular file")
            hdr = f.read(_HEADER.size)
            if len(hdr) != _HEADER.size:
                raise SsdCorrupt(f"{path.name}: short header")
            magic, klen, plen, digest = _HEADER.unpack(hdr)
            if magic != _MAGIC or klen > 1 << 20:
                raise SsdCorrupt(f"{path.name}: not an object file")
            kb = f.read(klen)
            try:
                got_key = kb.decode("utf-8", "surrogatepass")
            except UnicodeDecodeError:
                raise SsdCorrupt(f"{path.name}: undecodable key") from None
            if len(kb) != klen or file_name(got_key) != path.name:
                raise SsdCorrupt(f"{path.name}: key does not map to this file")
            if key is not None and got_key != key:
                raise SsdCorrupt(f"{path.name}: holds {got_key!r}, not {key!r}")
            if size is not None and plen != size:
                raise SsdCorrupt(f"{path.name}: {plen} bytes, index says {size}")
            data = f.read(plen + 1)
            if len(data) != plen:
                raise SsdCorrupt(f"{path.name}: {len(data)} payload bytes, header says "
                                 f"{plen}")
            if _digest(kb, data) != digest:
                raise SsdCorrupt(f"{path.name}: checksum mismatch")
            return got_key, data

    def get(self, key: str) -> bytes | None:
        with self._lock:
            size = self._index.get(key)
            if size is None:
                return None
            self._index.move_to_end(key)
            try:
                _, data = self._read_checked(self._file(key), key, size)
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

    # -- recovery ------------------------------------------------------------------------

    def scan(self, verify: bool = True) -> ScanReport:
        """Rebuild the index from the directory (see module docstring). Idempotent; never
        raises for a bad entry, never follows a symlink; this tier's orphan temporary
        files (a crash before their rename) are removed, any other stray entry is left
        alone and reported. ``verify`` also checks every payload's digest (reads every
        byte); without it damaged payloads are found on ``get``."""
        rep = ScanReport()
        index: OrderedDict[str, int] = OrderedDict()
        with self._lock:
            entries = sorted(os.scandir(self.path), key=lambda e: e.name)
            for e in entries:
                if e.name == _LOCK:
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
                    key, size = self._scan_header(Path(e.path))
                    if verify:
                        self._read_checked(Path(e.path), key, size)
                except (SsdCorrupt, OSError) as err:
                    rep.skipped.append((e.name, str(err)))
                    continue
                index[key] = size
            self._index = index
            self.used_bytes = sum(index.values())
            rep.registered, rep.used_bytes = len(index), self.used_bytes
        self.last_scan = rep
        return rep

    @staticmethod
    def _scan_header(path: Path) -> tuple[str, int]:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            hdr = f.read(_HEADER.size)
            if len(hdr) != _HEADER.size:
                raise SsdCorrupt("short header")
            magic, klen, plen, _ = _HEADER.unpack(hdr)
            if magic != _MAGIC or klen > 1 << 20:
                raise SsdCorrupt("not an object file")
            if st.st_size != _HEADER.size + klen + plen:
                raise SsdCorrupt(f"{st.st_size} bytes on disk, header says "
                                 f"{_HEADER.size + klen + plen}")
            kb = f.read(klen)
        try:
            key = kb.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            raise SsdCorrupt("undecodable key") from None
        if not key or file_name(key) != path.name:
            raise SsdCorrupt("key does not map to this file name")
        return key, plen

    # -- async wrappers ------------------------------------------------------------------

    async def aput(self, key: str, data: bytes | memoryview) -> list[str]:
        return await asyncio.to_thread(self.put, key, data)

    async def aget(self, key: str) -> bytes | None:
        return await asyncio.to_thread(self.get, key)

    async def aremove(self, key: str) -> bool:
        return await asyncio.to_thread(self.remove, key)
