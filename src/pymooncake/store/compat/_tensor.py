"""Tensor serialisation of the compat store, in Mooncake's object layout so tensors written
by either side read back on the other: a 304-byte ``TensorMetadata`` (a 40-byte header —
magic ``0x4d4f4f4e``, version 1, header size, dtype code, ndim, layout kind FULL/SHARD,
flags, data offset, data bytes — then the global and local shapes, 8 ``int64`` each padded
with -1, and up to 4 layout axes), then the raw bytes in C order (all little-endian).

The store never imports torch: a torch tensor is recognised by its attributes, and a tensor
read back is a torch tensor when torch is already imported by the caller, else a numpy
array (bfloat16/float8 then come back as their raw ``uint16``/``uint8`` storage)."""

from __future__ import annotations

import ctypes
import struct
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC, VERSION = 0x4D4F4F4E, 1
_HEADER = struct.Struct("<IHHiiIIQQ")  # 40 bytes
_SHAPE = struct.Struct("<8q")  # 64 bytes
_AXES_HEAD = struct.Struct("<II")
_AXIS = struct.Struct("<iiiiiiq")  # 32 bytes
MAX_DIMS, MAX_AXES = 8, 4
METADATA_SIZE = _HEADER.size + 2 * _SHAPE.size + _AXES_HEAD.size + MAX_AXES * _AXIS.size
assert METADATA_SIZE == 304
FULL, SHARD = 0, 1
AXIS_TP = 1

# Mooncake's TensorDtype codes: (torch name, numpy storage dtype)
_DTYPES: list[tuple[str, str]] = [
    ("float32", "float32"), ("float64", "float64"), ("int8", "int8"), ("uint8", "uint8"),
    ("int16", "int16"), ("uint16", "uint16"), ("int32", "int32"), ("uint32", "uint32"),
    ("int64", "int64"), ("uint64", "uint64"), ("bool", "bool"), ("float16", "float16"),
    ("bfloat16", "uint16"), ("float8_e4m3fn", "uint8"), ("float8_e5m2", "uint8")]
_CODE = {name: i for i, (name, _) in enumerate(_DTYPES)}


@dataclass(frozen=True)
class Meta:
    """A parsed ``TensorMetadata``."""

    dtype: int
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    kind: int
    axes: tuple[tuple[int, int, int, int], ...]  # (kind, rank, count, split_dim)
    data_offset: int
    data_bytes: int


def _is_torch(x: Any) -> bool:
    return hasattr(x, "untyped_storage") and hasattr(x, "dtype")


def raw_of(tensor: Any) -> tuple[int, tuple[int, ...], Any]:
    """(dtype code, shape, C-order bytes as a buffer) of a torch tensor or numpy array;
    ``TypeError`` for anything else or an unsupported dtype."""
    if isinstance(tensor, np.ndarray):
        arr = np.ascontiguousarray(tensor)
        name = str(arr.dtype)
        if name not in _CODE or name in ("bfloat16",):
            raise TypeError(f"unsupported dtype {name}")
        return _CODE[name], tuple(arr.shape), memoryview(arr.reshape(-1).view(np.uint8))
    if _is_torch(tensor):
        torch = sys.modules["torch"]  # already imported by whoever made the tensor
        t = tensor.detach().cpu().contiguous()
        name = str(t.dtype).removeprefix("torch.")
        if name not in _CODE:
            raise TypeError(f"unsupported dtype {name}")
        flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0,
                                                                             dtype=torch.uint8)
        return _CODE[name], tuple(t.shape), memoryview(flat.numpy())
    raise TypeError(f"expected a torch tensor or numpy array, got {type(tensor).__name__}")


def metadata(dtype: int, shape: tuple[int, ...], data_bytes: int, *,
             global_shape: tuple[int, ...] | None = None, kind: int = FULL,
             axes: tuple[tuple[int, int, int, int], ...] = ()) -> bytes:
    """The 304-byte ``TensorMetadata`` for a tensor of ``shape`` (the stored piece)."""
    if len(shape) > MAX_DIMS:
        raise TypeError(f"a tensor has at most {MAX_DIMS} dims, got {len(shape)}")
    g = shape if global_shape is None else global_shape
    pad = (-1,) * MAX_DIMS
    out = [_HEADER.pack(MAGIC, VERSION, METADATA_SIZE, dtype, len(shape), kind, 0,
                        METADATA_SIZE, data_bytes),
           _SHAPE.pack(*(tuple(g) + pad)[:MAX_DIMS]),
           _SHAPE.pack(*(tuple(shape) + pad)[:MAX_DIMS]),
           _AXES_HEAD.pack(len(axes), 0)]
    for i in range(MAX_AXES):
        if i < len(axes):  # (kind, rank, count, split dim or -1[, expert/stage id]);
            k, rank, count, dim, *extra = axes[i]  # last: the extent along the split dim
            out.append(_AXIS.pack(k, i, rank, count, dim, extra[0] if extra else 0,
                                  shape[dim] if dim >= 0 else 0))
        else:
            out.append(bytes(_AXIS.size))
    return b"".join(out)


def tensor_bytes(tensor: Any) -> bytes:
    """The serialised tensor (metadata + bytes); ``TypeError`` for a non-tensor."""
    code, shape, raw = raw_of(tensor)
    return metadata(code, shape, raw.nbytes) + bytes(raw)


def parse(head: Any, total: int) -> Meta | None:
    """The metadata at the start of an object of ``total`` bytes, or None when it is not
    a valid tensor object (checked as Mooncake checks it)."""
    if total < METADATA_SIZE or len(head) < METADATA_SIZE:
        return None
    magic, ver, hsize, dtype, ndim, kind, _f, off, nbytes = _HEADER.unpack_from(head, 0)
    if (magic, ver, hsize) != (MAGIC, VERSION, METADATA_SIZE) or not 0 <= dtype < len(
            _DTYPES) or not 0 <= ndim <= MAX_DIMS or kind > SHARD:
        return None
    g = _SHAPE.unpack_from(head, _HEADER.size)[:ndim]
    loc = _SHAPE.unpack_from(head, _HEADER.size + _SHAPE.size)[:ndim]
    naxes, _ = _AXES_HEAD.unpack_from(head, _HEADER.size + 2 * _SHAPE.size)
    if naxes > MAX_AXES or any(d < 0 for d in g + loc) or off < METADATA_SIZE:
        return None
    base = _HEADER.size + 2 * _SHAPE.size + _AXES_HEAD.size
    axes = tuple((a[0], a[2], a[3], a[4]) for a in (
        _AXIS.unpack_from(head, base + i * _AXIS.size) for i in range(naxes)))
    itemsize = np.dtype(_DTYPES[dtype][1]).itemsize
    if nbytes != int(np.prod(loc, dtype=np.int64)) * itemsize or off + nbytes > total:
        return None
    return Meta(dtype, tuple(loc), tuple(g), kind, axes, off, nbytes)


def build(meta: Meta, raw: Any) -> Any:
    """A tensor over ``raw`` (a writable buffer of ``meta.data_bytes``; not copied)."""
    name, storage = _DTYPES[meta.dtype]
    torch = sys.modules.get("torch")
    if torch is not None:
        dt = getattr(torch, name)
        flat = torch.frombuffer(raw, dtype=torch.uint8) if len(raw) else torch.empty(
            0, dtype=torch.uint8)
        return flat.view(dt).reshape(meta.local_shape)
    return np.frombuffer(raw, dtype=np.dtype(storage)).reshape(meta.local_shape)


def tensor_from(data: bytes) -> Any:
    """The tensor in ``data`` (a copy), or None when ``data`` is not a serialised tensor."""
    m = parse(data, len(data))
    if m is None:
        return None
    return build(m, bytearray(data[m.data_offset:m.data_offset + m.data_bytes]))


def meta_at(addr: int, size: int) -> Meta | None:
    if size < METADATA_SIZE:
        return None
    return parse(ctypes.string_at(addr, METADATA_SIZE), size)


def tensor_at(addr: int, size: int) -> Any:
    """The tensor serialised at ``[addr, addr+size)``, viewing that memory (no copy)."""
    m = meta_at(addr, size)
    if m is None:
        return None
    raw = (ctypes.c_uint8 * m.data_bytes).from_address(addr + m.data_offset)
    return build(m, memoryview(raw).cast("B"))
