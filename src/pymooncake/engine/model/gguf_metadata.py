"""The key-value metadata of a GGUF file, read without touching its tensors.

A GGUF file is ``magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count`` followed by
``kv_count`` entries ``string key | u32 type | value`` (little-endian; strings are a u64
length then UTF-8 bytes; an array is ``u32 element type | u64 count | elements``), then the
tensor infos and the tensor data, which this module never reads. ``gguf.GGUFReader`` maps
every tensor and wraps every array element in a numpy view (about 2 s for SmolLM2's 98k
tokenizer strings); the API front door and each worker read the tokenizer at start, so
this reader parses only the metadata section (tens of milliseconds).
"""

from __future__ import annotations

import mmap
import struct
from array import array
from collections.abc import Iterable
from pathlib import Path
from typing import Any

GGUF_MAGIC = b"GGUF"

# GGUF value types -> struct format of one scalar (8 = string, 9 = array are special).
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
           10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    def __init__(self, buf: bytes, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if n < 0 or end > len(self.buf):
            raise ValueError(f"{self.path}: truncated GGUF metadata at byte {self.pos}")
        out = self.buf[self.pos:end]
        self.pos = end
        return out

    def scalar(self, fmt: str) -> Any:
        v = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("Q")
        return self.take(n).decode("utf-8", errors="surrogateescape")

    def value(self, vtype: int, keep: bool) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype in _SCALAR:
            return self.scalar(_SCALAR[vtype])
        if vtype != _ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.pos}")
        etype, count = self.scalar("I"), self.scalar("Q")
        if etype == _STRING:
            return self._strings(count, keep)
        if etype in _SCALAR:
            fmt = _SCALAR[etype]
            raw = self.take(count * struct.calcsize(fmt))
            if not keep:
                return None
            if fmt == "?":
                return [b != 0 for b in raw]
            arr = array(fmt)
            arr.frombytes(raw)
            return arr.tolist()
        return [self.value(etype, keep) for _ in range(count)]  # nested arrays (rare)

    def _strings(self, count: int, keep: bool) -> list[str] | None:
        buf, pos, unpack = self.buf, self.pos, struct.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            (n,) = unpack("<Q", buf, pos)
            pos += 8
            if keep:
                append(buf[pos:pos + n].decode("utf-8", errors="surrogateescape"))
            pos += n
        if pos > len(buf):
            raise ValueError(f"{self.path}: truncated GGUF metadata (string array)")
        self.pos = pos
        return out if keep else None


def read_gguf_metadata(path: str | Path, keys: Iterable[str] | None = None) -> dict[str, Any]:
    """The metadata of the GGUF file at ``path`` as ``{key: value}``.

    Scalars come back as Python ints/floats/bools/strs, arrays as lists. ``keys``, when
    given, limits the returned entries (the others are skipped, not decoded).

    Raises:
        ValueError: the file is not GGUF (bad magic or version) or its metadata is cut short.
        OSError: the file cannot be read.
    """
    p = Path(path)
    wanted = None if keys is None else set(keys)
    with p.open("rb") as f:
        head = f.read(24)
        if len(head) < 24 or head[:4] != GGUF_MAGIC:
            raise ValueError(f"{p}: not a GGUF file (magic {head[:4]!r}, expected {GGUF_MAGIC!r})")
        version = struct.unpack_from("<I", head, 4)[0]
        if version not in (2, 3):
            raise ValueError(f"{p}: unsupported GGUF version {version} (need 2 or 3, "
                             "little-endian)")
        n_kv = struct.unpack_from("<Q", head, 16)[0]
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            cur = _Cursor(mm, p)  # type: ignore[arg-type]  # mmap slices like bytes
            cur.pos = 24
            out: dict[str, Any] = {}
            try:
                for _ in range(n_kv):
                    key = cur.string()
                    vtype = cur.scalar("I")
                    keep = wanted is None or key in wanted
                    v = cur.value(vtype, keep)
                    if keep:
                        out[key] = v
            except struct.error:
                raise ValueError(f"{p}: truncated GGUF metadata at byte {cur.pos}") from None
    return out
