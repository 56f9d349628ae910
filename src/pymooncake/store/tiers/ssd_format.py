"""The SSD tier's object file format (one object per file, self-checking).

A file is ``HEADER`` (magic ``PMS2``, key bytes, payload bytes, XXH3-128 of key ‖ payload),
then the key (UTF-8), then the payload; it is named ``file_name(key)`` (40 hex digits of
the key's BLAKE3 + ``.obj``). Files written before XXH3 (magic ``PMS1``, ``HEADER_V1``: a
32-byte BLAKE3 digest) are still read, and checked with their own algorithm.
``read_checked`` returns a file's key and payload only when every field and the digest
agree (``SsdCorrupt`` otherwise, BUG-60); ``scan_header`` reads just the header and key
(and checks the file's length) for a recovery scan.
"""

from __future__ import annotations

import os
import stat
import struct
from pathlib import Path
from typing import BinaryIO

import blake3
import xxhash

SUFFIX = ".obj"
MAGIC = b"PMS2"
HEADER = struct.Struct("<4sIQ16s")  # magic, key bytes, payload bytes, xxh3_128(key ‖ payload)
MAGIC_V1 = b"PMS1"
HEADER_V1 = struct.Struct("<4sIQ32s")  # before XXH3: the digest is blake3(key ‖ payload)
_HEADERS = {MAGIC: HEADER, MAGIC_V1: HEADER_V1}


class SsdCorrupt(Exception):
    """A stored object failed its checksum or header check (``INTEGRITY_ERROR``)."""


def record_digest(key: bytes, data: bytes | memoryview, magic: bytes = MAGIC) -> bytes:
    """The header's digest of ``key`` ‖ ``data`` in the format of ``magic``."""
    h = xxhash.xxh3_128(key) if magic == MAGIC else blake3.blake3(key)
    h.update(data)
    return h.digest()


def _header(f: BinaryIO, name: str) -> tuple[int, bytes, int, int, bytes]:
    """(header bytes, magic, key bytes, payload bytes, digest) read from ``f``'s start;
    ``SsdCorrupt`` when short or of an unknown format."""
    head = f.read(4)
    fmt = _HEADERS.get(head)
    if fmt is None:
        raise SsdCorrupt(f"{name}short header" if len(head) < 4 else f"{name}not an object file")
    rest = f.read(fmt.size - 4)
    if len(rest) != fmt.size - 4:
        raise SsdCorrupt(f"{name}short header")
    magic, klen, plen, digest = fmt.unpack(head + rest)
    if klen > 1 << 20:
        raise SsdCorrupt(f"{name}not an object file")
    return fmt.size, magic, klen, plen, digest


def file_name(key: str) -> str:
    """The file name an object of ``key`` is stored under (40 hex digits + ``.obj``)."""
    return blake3.blake3(key.encode("utf-8", "surrogatepass")).hexdigest()[:40] + SUFFIX


def read_checked(path: Path, key: str | None, size: int | None) -> tuple[str, bytes]:
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
        _, magic, klen, plen, digest = _header(f, f"{path.name}: ")
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
        if record_digest(kb, data, magic) != digest:
            raise SsdCorrupt(f"{path.name}: checksum mismatch")
        return got_key, data


def scan_header(path: Path) -> tuple[str, int]:
    """(key, payload bytes) from a file's header alone; ``SsdCorrupt`` when the header,
    the file's length or the key's file name disagree."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        hsize, _, klen, plen, _ = _header(f, "")
        if st.st_size != hsize + klen + plen:
            raise SsdCorrupt(f"{st.st_size} bytes on disk, header says "
                             f"{hsize + klen + plen}")
        kb = f.read(klen)
    try:
        key = kb.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        raise SsdCorrupt("undecodable key") from None
    if not key or file_name(key) != path.name:
        raise SsdCorrupt("key does not map to this file name")
    return key, plen
