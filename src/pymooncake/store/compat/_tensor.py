"""Tensor serialisation of the compat store: a header (magic ``PMT1``, u32 length, JSON
dtype + shape + kind) then the raw bytes in C order. Not Mooncake's ``TensorMetadata``
layout (docs/store.md, "Differences from Mooncake")."""

from __future__ import annotations

import ctypes
import json
import struct
import sys
from typing import Any

import numpy as np

_TENSOR_MAGIC = b"PMT1"


def tensor_bytes(tensor: Any) -> bytes:
    """The serialised tensor (torch tensor or numpy array); ``TypeError`` for others."""
    if isinstance(tensor, np.ndarray):
        arr = np.ascontiguousarray(tensor)
        dtype, shape, raw = str(arr.dtype), list(arr.shape), arr.tobytes()
        kind = "numpy"
    elif hasattr(tensor, "dtype") and hasattr(tensor, "untyped_storage"):  # a torch tensor
        torch = sys.modules["torch"]  # already imported by whoever made the tensor
        t = tensor.detach().cpu().contiguous()
        dtype, shape = str(t.dtype).removeprefix("torch."), list(t.shape)
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        kind = "torch"
    else:
        raise TypeError(f"expected a torch tensor or numpy array, got {type(tensor).__name__}")
    header = json.dumps({"dtype": dtype, "shape": shape, "kind": kind}).encode()
    return _TENSOR_MAGIC + struct.pack("<I", len(header)) + header + raw


def _meta(head: bytes) -> tuple[dict[str, Any], int] | None:
    if len(head) < 8 or head[:4] != _TENSOR_MAGIC:
        return None
    (n,) = struct.unpack("<I", head[4:8])
    return json.loads(head[8:8 + n]), 8 + n


def _build(meta: dict[str, Any], raw: Any) -> Any:
    """A tensor over ``raw`` (a writable buffer; not copied)."""
    torch = sys.modules.get("torch")
    if meta.get("kind") == "torch" and torch is not None:
        dt = getattr(torch, meta["dtype"])
        flat = torch.frombuffer(raw, dtype=torch.uint8) if len(raw) else \
            torch.empty(0, dtype=torch.uint8)
        return flat.view(dt).reshape(meta["shape"])
    return np.frombuffer(raw, dtype=np.dtype(meta["dtype"])).reshape(meta["shape"])


def tensor_from(data: bytes) -> Any:
    """The tensor in ``data`` (a copy), or None when ``data`` is not a serialised tensor."""
    m = _meta(data[:8 + 65536])
    if m is None:
        return None
    return _build(m[0], bytearray(data[m[1]:]))


def tensor_at(addr: int, size: int) -> Any:
    """The tensor serialised at ``[addr, addr+size)``, viewing that memory (no copy)."""
    if size < 8:
        return None
    (n,) = struct.unpack("<I", ctypes.string_at(addr + 4, 4))
    m = _meta(ctypes.string_at(addr, min(size, 8 + n)))
    if m is None:
        return None
    raw = (ctypes.c_uint8 * (size - m[1])).from_address(addr + m[1])
    return _build(m[0], memoryview(raw).cast("B"))
