"""The safetensors file format for ``save_tensor_to_safetensor`` /
``load_tensor_from_safetensor``: a little-endian u64 header length, a JSON header
``{name: {dtype, shape, data_offsets}}``, then the raw bytes. Written and read here so the
store needs neither torch nor the safetensors package; files are readable by
``safetensors.torch.load_file`` and the other way round."""

from __future__ import annotations

import json
import os
import struct
from typing import Any

from pymooncake.store.compat._tensor import Meta

FILE_NOT_FOUND = -1100
# Mooncake's dtype codes (``_tensor._DTYPES`` order) ↔ safetensors dtype names
_NAMES = ["F32", "F64", "I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64", "BOOL", "F16",
          "BF16", "F8_E4M3", "F8_E5M2"]
_MAX_HEADER = 100 << 20


def save(path: str, name: str, meta: Meta, raw: Any) -> None:
    """Writes one tensor ``name`` (``raw``: its C-order bytes) to ``path``, atomically."""
    header = {name: {"dtype": _NAMES[meta.dtype], "shape": list(meta.local_shape),
                     "data_offsets": [0, len(raw)]}}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format aligns the data to 8 bytes
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        f.write(raw)
    os.replace(tmp, path)


def load(path: str) -> dict[str, tuple[int, tuple[int, ...], bytes]]:
    """Every tensor in the file: name → (dtype code, shape, bytes), in file order.
    ``ValueError`` for a file that is not valid safetensors."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError(f"{path}: too short for a safetensors file")
    (n,) = struct.unpack_from("<Q", data, 0)
    if n > min(_MAX_HEADER, len(data) - 8):
        raise ValueError(f"{path}: header length {n} out of range")
    try:
        header = json.loads(data[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: bad header: {e}") from None
    body = memoryview(data)[8 + n:]
    out = {}
    for name, ent in header.items():
        if name == "__metadata__":
            continue
        try:
            code = _NAMES.index(ent["dtype"])
            shape = tuple(int(d) for d in ent["shape"])
            lo, hi = (int(x) for x in ent["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: bad entry {name!r}") from None
        if not 0 <= lo <= hi <= len(body):
            raise ValueError(f"{path}: entry {name!r} outside the file")
        out[name] = (code, shape, bytes(body[lo:hi]))
    return out
