"""The one parser of the GGUF binary layout (llama.cpp's model file): header, metadata
key/values and tensor infos, never the tensor data.

Spec followed: the GGUF file format (ggml's ``docs/gguf.md``, versions 2 and 3,
little-endian): ``magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count``, then
``kv_count`` entries ``string key | u32 value type | value`` (a string is a u64 length and
UTF-8 bytes; an array is ``u32 element type | u64 count | elements``), then
``tensor_count`` tensor infos ``string name | u32 n_dims | u64 dims[n_dims]`` (innermost
first) ``| u32 ggml type | u64 offset`` (relative to the data section), then the tensor
data, which starts at the next multiple of ``general.alignment`` (default 32).

Why not ``gguf.GGUFReader``: it maps every tensor and wraps every array element in a numpy
view, ~1.8 s for SmolLM2's 49k vocabulary strings; this parser takes ~0.03 s on it (with
or without the tensor infos) and imports neither numpy nor torch, so the API front door
can read a tokenizer without them. Users: ``gguf.py`` (weights) and
``tokenizer.py`` (``GGUFTokenizer``).

Errors: ``GGUFError`` (a ``ValueError``), one line naming the file and what is wrong: not a
GGUF file, an unsupported version, truncated or corrupt (naming the metadata key or tensor
being read), tensor data past the end of the file, an unreadable file. ``gguf.py``
re-raises it as ``ModelLoadError`` with the same message.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# ggml tensor types (ggml.h ``enum ggml_type``) → (name, elements per block, bytes per block)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34),
    30: ("BF16", 1, 2),
}
"""The ggml types ``gguf.py`` dequantizes (their sizes are known); others are refused by
name."""
_GGML_TYPE_NAMES = {2: "Q4_0", 6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K",
                    12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
                    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
                    22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64",
                    28: "F64", 29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}

# GGUF metadata value types → struct format of one scalar; 8 = string, 9 = array
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
           10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """A GGUF file cannot be parsed; the one-line message names the file and the fault."""


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    """One tensor of a GGUF file."""

    name: str
    shape: tuple[int, ...]
    """PyTorch order, outermost first (GGUF stores dims innermost first): a linear weight
    is ``[out_features, in_features]``."""
    ggml_type: int
    """ggml type id (``GGML_TYPES`` keys are the supported ones)."""
    offset: int
    """Absolute byte offset of the data in the file."""
    nbytes: int
    """Bytes of data (0 when the type is unsupported: the size is then unknown)."""

    @property
    def type_name(self) -> str:
        return (GGML_TYPES.get(self.ggml_type, (None,))[0]
                or _GGML_TYPE_NAMES.get(self.ggml_type, f"type {self.ggml_type}"))


@dataclass(frozen=True, slots=True)
class GGUFFile:
    """The parsed header of a GGUF file: metadata and tensor infos (no tensor data)."""

    path: Path
    version: int
    metadata: dict[str, Any]
    """Key → value: scalars as Python ints/floats/bools/strs, arrays as lists (strings
    decoded as UTF-8 with ``surrogateescape``, so invalid bytes survive a round trip)."""
    tensors: dict[str, GGUFTensorInfo]
    """Name → info, in file order (empty when read with ``tensors=False``)."""
    data_offset: int
    """Absolute byte offset of the tensor data section (0 when read with ``tensors=False``)."""
    file_size: int


class _Cursor:
    """Sequential little-endian reader over the mapped file. Reading past the end raises
    ``struct.error``; ``where`` names the key or tensor being read, for the error."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos, self.where = buf, 0, "the header"

    def scalar(self, fmt: str) -> Any:
        (v,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.buf):
            raise struct.error("past the end of the file")
        out = self.buf[self.pos:end]
        self.pos = end
        return out

    def string(self) -> str:
        return self.take(self.scalar("Q")).decode("utf-8", errors="surrogateescape")

    def value(self, vtype: int, keep: bool) -> Any:
        """The value of type ``vtype``; ``None`` for an array not kept (skipped, not
        decoded)."""
        if vtype == _STRING:
            return self.string()
        if vtype in _SCALAR:
            return self.scalar(_SCALAR[vtype])
        if vtype != _ARRAY:
            raise ValueError(f"unknown value type {vtype}")
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
        """A string array in one tight loop (SmolLM2's vocabulary: 49k strings)."""
        buf, pos, unpack, size = self.buf, self.pos, struct.unpack_from, len(self.buf)
        out: list[str] = []
        append = out.append
        for _ in range(count):
            (n,) = unpack("<Q", buf, pos)
            pos += 8
            if keep:
                append(buf[pos:pos + n].decode("utf-8", errors="surrogateescape"))
            pos += n
            if pos > size:
                raise struct.error("past the end of the file")
        self.pos = pos
        return out if keep else None


def read_gguf_header(path: str | Path, keys: Iterable[str] | None = None, *,
                     tensors: bool = True) -> GGUFFile:
    """Parse the header of the GGUF file at ``path``.

    ``keys``, when given, limits the metadata returned (the other values are skipped, not
    decoded; ``general.alignment`` is always kept); ``tensors=False`` stops after the
    metadata (no tensor infos, ``data_offset`` 0). With the tensor infos, every tensor of a
    known type is checked to end inside the file.

    Raises ``GGUFError`` (one line, naming the file, and the key or tensor at fault).
    """
    p = Path(path)
    buf = map_gguf(p)
    try:
        if buf[:4] != GGUF_MAGIC:
            raise GGUFError(f"{p}: not a GGUF file (magic {buf[:4]!r}, expected "
                            f"{GGUF_MAGIC!r})")
        if len(buf) < 24:
            raise GGUFError(f"{p}: GGUF header is truncated ({len(buf)} bytes)")
        return _parse(p, buf, None if keys is None else set(keys), tensors)
    finally:
        buf.close()


def map_gguf(path: str | Path) -> mmap.mmap:
    """The whole file mapped read-only (the caller closes it). Raises ``GGUFError``: the
    file cannot be read, or is empty (not a GGUF file)."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise GGUFError(f"{p}: not a GGUF file (empty)")
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise GGUFError(f"{p}: cannot read ({e.strerror or e})") from None


def read_gguf_metadata(path: str | Path, keys: Iterable[str] | None = None) -> dict[str, Any]:
    """The metadata of the GGUF file at ``path`` as ``{key: value}`` (only ``keys`` when
    given); the tensor infos are not read. Raises ``GGUFError``."""
    return read_gguf_header(path, keys, tensors=False).metadata


def _parse(p: Path, buf: mmap.mmap, wanted: set[str] | None, with_tensors: bool) -> GGUFFile:
    r = _Cursor(buf)
    r.pos = 4
    version = r.scalar("I")
    if version not in SUPPORTED_VERSIONS:
        swapped = " (big-endian files are not supported)" if version & 0xFFFF == 0 else ""
        raise GGUFError(f"{p}: GGUF version {version} is not supported{swapped}; "
                        f"supported: {SUPPORTED_VERSIONS}")
    n_tensors, n_kv = r.scalar("Q"), r.scalar("Q")
    metadata: dict[str, Any] = {}
    raw: list[tuple[str, tuple[int, ...], int, int]] = []
    try:
        for i in range(n_kv):
            r.where = f"metadata entry {i}"
            key = r.string()
            r.where = f"metadata key {key!r}"
            keep = wanted is None or key in wanted or key == "general.alignment"
            value = r.value(r.scalar("I"), keep)
            if keep:
                metadata[key] = value
        if with_tensors:
            for i in range(n_tensors):
                r.where = f"tensor info {i}"
                name = r.string()
                r.where = f"tensor {name!r}"
                dims = [r.scalar("Q") for _ in range(r.scalar("I"))]
                raw.append((name, tuple(reversed(dims)), r.scalar("I"), r.scalar("Q")))
    except (struct.error, ValueError, OverflowError) as e:
        why = "past the end of the file" if isinstance(e, struct.error) else str(e)
        raise GGUFError(f"{p}: GGUF header is truncated or corrupt at byte {r.pos}, "
                        f"reading {r.where} ({why})") from None
    if not with_tensors:
        return GGUFFile(p, version, metadata, {}, 0, len(buf))
    align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise GGUFError(f"{p}: general.alignment {align!r} is not a power of two")
    data_start = -(-r.pos // align) * align
    size = len(buf)
    infos: dict[str, GGUFTensorInfo] = {}
    for name, shape, gtype, rel in raw:
        nbytes = 0
        if gtype in GGML_TYPES:
            _, block, block_bytes = GGML_TYPES[gtype]
            nbytes = math.prod(shape) // block * block_bytes
        info = GGUFTensorInfo(name, shape, gtype, data_start + rel, nbytes)
        if info.offset + nbytes > size:
            raise GGUFError(f"{p}: truncated: tensor {name!r} ends at byte "
                            f"{info.offset + nbytes}, the file has {size}")
        infos[name] = info
    return GGUFFile(p, version, metadata, infos, data_start, size)
