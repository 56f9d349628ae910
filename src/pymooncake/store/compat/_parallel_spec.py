"""Mooncake's unified-parallelism layout description (``ParallelAxis``,
``TensorParallelism``, ``ReadTarget``, writer partitions) and what the store derives from
it: validation (Mooncake's rules), the key each shard is stored under, the layout
manifests, and byte-level splitting/joining of C-order tensor data.

Source: Mooncake's docs/source/design/store/unified-parallel-tensor-io.md and
``mooncake-integration/store/store_py_internal.h`` (read for the contract; nothing copied).
Axis kinds are ``"tp"``, ``"dp"``, ``"ep"``, ``"pp"`` (case-insensitive); a TP axis needs
``split_dim``, DP/EP/PP must not have one, EP needs ``expert_id``, PP needs ``stage_id``,
``0 <= rank < size``, at most 4 axes and no kind twice. Key names, as Mooncake's:

- a single TP axis (the ``*_with_tp`` wrappers' layout): ``f"{key}_tp_{rank}"``;
- any other axis list, in canonical order DP, TP, EP, PP:
  ``key + "".join(f"__{kind}_{rank}of{size}[_sd{d}][_eid{e}][_sid{s}]")``;
- a writer partition: ``f"{key}__writer_{rank}of{size}_sd{split_dim}"``.

A 96-byte manifest (magic ``0x574d414e``, version 1, header size, dtype, ndim, split dim,
shard count, 4 bytes of padding, then the global shape as 8 ``int64``) under
``f"{key}__parallelism_manifest"`` or ``f"{key}__writer_manifest"`` records the layout of
``key``'s shard set, so a ``full`` or re-sharding read knows how many shards to gather (the
target's non-TP axes name the shards)."""

from __future__ import annotations

import copy
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pymooncake.store.compat import _tensor

KINDS = {"dp": 0, "tp": 1, "ep": 2, "pp": 3}  # Mooncake's LayoutAxisKind codes
_ORDER = {"dp": 0, "tp": 1, "ep": 2, "pp": 3}  # canonical order of the key suffix
MAX_AXES = 4
_MANIFEST = struct.Struct("<IHHiiiii4x8q")  # 96 bytes (C padding before the shape)
_MANIFEST_MAGIC = 0x574D414E


def _opt_int(name: str, v: Any) -> int | None:
    if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
        raise TypeError(f"{name} must be an int or None, got {type(v).__name__}")
    return v


def _int(name: str, v: Any) -> int:
    if v is None:
        raise TypeError(f"{name} must be an int, got None")
    return _opt_int(name, v)  # type: ignore[return-value]


class ParallelAxis:
    """One parallel axis of a shard's identity: ``kind`` ("tp"/"dp"/"ep"/"pp"), ``rank``
    in ``[0, size)``, ``split_dim`` (TP only), ``expert_id`` (EP), ``stage_id`` (PP).
    Fields are set after construction, as on Mooncake's pybind class; a wrong type raises
    ``TypeError``."""

    __slots__ = ("_kind", "_rank", "_size", "_split_dim", "_expert_id", "_stage_id")

    def __init__(self) -> None:
        self._kind, self._rank, self._size = "", 0, 1
        self._split_dim = self._expert_id = self._stage_id = None

    @property
    def kind(self) -> str:
        return self._kind

    @kind.setter
    def kind(self, v: str) -> None:
        if not isinstance(v, str):
            raise TypeError(f"kind must be a str, got {type(v).__name__}")
        self._kind = v

    @property
    def rank(self) -> int:
        return self._rank

    @rank.setter
    def rank(self, v: int) -> None:
        self._rank = _int("rank", v)

    @property
    def size(self) -> int:
        return self._size

    @size.setter
    def size(self, v: int) -> None:
        self._size = _int("size", v)

    @property
    def split_dim(self) -> int | None:
        return self._split_dim

    @split_dim.setter
    def split_dim(self, v: int | None) -> None:
        self._split_dim = _opt_int("split_dim", v)

    @property
    def expert_id(self) -> int | None:
        return self._expert_id

    @expert_id.setter
    def expert_id(self, v: int | None) -> None:
        self._expert_id = _opt_int("expert_id", v)

    @property
    def stage_id(self) -> int | None:
        return self._stage_id

    @stage_id.setter
    def stage_id(self, v: int | None) -> None:
        self._stage_id = _opt_int("stage_id", v)

    def __repr__(self) -> str:
        return (f"ParallelAxis(kind={self.kind!r}, rank={self.rank}, size={self.size}, "
                f"split_dim={self.split_dim}, expert_id={self.expert_id}, "
                f"stage_id={self.stage_id})")


class TensorParallelism:
    """A shard's identity as a list of ``ParallelAxis`` (``axes``); assigning copies the
    axes (Mooncake's value semantics), reading returns the held list."""

    __slots__ = ("_axes",)

    def __init__(self) -> None:
        self._axes: list[ParallelAxis] = []

    @property
    def axes(self) -> list[ParallelAxis]:
        return self._axes

    @axes.setter
    def axes(self, v: Any) -> None:
        if isinstance(v, str | bytes) or not isinstance(v, Iterable):
            raise TypeError(f"axes must be a list of ParallelAxis, got {v!r}")
        items = list(v)
        if not all(isinstance(a, ParallelAxis) for a in items):
            raise TypeError("axes must be a list of ParallelAxis")
        self._axes = [copy.copy(a) for a in items]

    def __repr__(self) -> str:
        return f"TensorParallelism(axes={self._axes!r})"


class ReadTarget:
    """What a read materialises: ``mode`` "as_stored" (the object under the key),
    "shard" (the shard ``parallelism`` names, re-sliced from the stored shard set when its
    layout differs) or "full" (the whole tensor, reconstructed). An unknown mode raises
    ``RuntimeError`` ("Unsupported ReadTarget mode"), as Mooncake."""

    __slots__ = ("_mode", "_parallelism")

    def __init__(self) -> None:
        self._mode = "as_stored"
        self._parallelism: TensorParallelism | None = None

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, v: str) -> None:
        if not isinstance(v, str):
            raise TypeError(f"mode must be a str, got {type(v).__name__}")
        m = v.lower()
        if m not in ("as_stored", "shard", "full"):
            raise RuntimeError("Unsupported ReadTarget mode")
        self._mode = m

    @property
    def parallelism(self) -> TensorParallelism | None:
        return self._parallelism

    @parallelism.setter
    def parallelism(self, v: TensorParallelism | None) -> None:
        if v is not None and not isinstance(v, TensorParallelism):
            raise TypeError("parallelism must be a TensorParallelism or None")
        self._parallelism = None if v is None else copy.deepcopy(v)


@dataclass(frozen=True)
class Axis:
    """A validated axis (kind lower-cased)."""

    kind: str
    rank: int
    size: int
    split_dim: int | None
    expert_id: int | None
    stage_id: int | None

    def suffix(self) -> str:
        s = f"{self.kind}_{self.rank}of{self.size}"
        for tag, v in (("sd", self.split_dim), ("eid", self.expert_id),
                       ("sid", self.stage_id)):
            if v is not None:
                s += f"_{tag}{v}"
        return s

    def layout(self) -> tuple[int, int, int, int, int]:
        """(kind code, rank, count, split dim or -1, expert/stage id) for the metadata."""
        extra = self.expert_id if self.kind == "ep" else self.stage_id if \
            self.kind == "pp" else 0
        return (KINDS[self.kind], self.rank, self.size,
                -1 if self.split_dim is None else self.split_dim, extra or 0)


def _axis_of(a: Any) -> Axis | None:
    """An axis object (anything with ``kind``/``rank``/``size`` and the optional fields,
    as Mooncake reads it) checked against Mooncake's rules, or None."""
    try:
        kind, rank, size = a.kind, a.rank, a.size
        sd, eid, sid = (getattr(a, f, None) for f in ("split_dim", "expert_id", "stage_id"))
    except AttributeError:
        return None
    ints = (rank, size) + tuple(v for v in (sd, eid, sid) if v is not None)
    if not isinstance(kind, str) or not all(isinstance(v, int) and not isinstance(v, bool)
                                            for v in ints):
        return None
    kind = kind.lower()
    if kind not in KINDS or size <= 0 or not 0 <= rank < size:
        return None
    if (kind == "tp") != (sd is not None):
        return None  # TP needs split_dim; DP/EP/PP must not have one
    if (kind == "ep" and eid is None) or (kind == "pp" and sid is None):
        return None
    return Axis(kind, rank, size, sd, eid if kind == "ep" else None,
                sid if kind == "pp" else None)


def validate(parallelism: Any) -> list[Axis] | None:
    """The axis list (the caller's order: the metadata keeps it) of a ``TensorParallelism`` (or any
    object with an ``axes`` list, as Mooncake accepts), or None when Mooncake rejects it:
    no axes, more than 4, an unknown kind, ``rank`` outside ``[0, size)``, a TP axis
    without ``split_dim`` or another axis with one, EP without ``expert_id``, PP without
    ``stage_id``, a kind twice."""
    axes = getattr(parallelism, "axes", None)
    if not isinstance(axes, list | tuple) or not axes or len(axes) > MAX_AXES:
        return None
    out = [_axis_of(a) for a in axes]
    if any(a is None for a in out):
        return None
    if len({a.kind for a in out if a}) != len(out):
        return None
    return [a for a in out if a]


def tp_of(axes: list[Axis]) -> Axis | None:
    return next((a for a in axes if a.kind == "tp"), None)


def shard_key(key: str, axes: list[Axis]) -> str:
    """Where the shard named by ``axes`` is stored."""
    if len(axes) == 1 and axes[0].kind == "tp":
        return f"{key}_tp_{axes[0].rank}"
    return key + "".join("__" + a.suffix() for a in _canonical(axes))


def _canonical(axes: list[Axis]) -> list[Axis]:
    """DP, TP, EP, PP: the order of the key suffixes."""
    return sorted(axes, key=lambda a: _ORDER[a.kind])


def group_key(key: str, axes: list[Axis]) -> str:
    """The shard set's name: ``key`` plus every non-TP axis."""
    return key + "".join("__" + a.suffix() for a in _canonical(axes) if a.kind != "tp")


def with_tp(axes: list[Axis], rank: int, size: int, split_dim: int) -> list[Axis]:
    """``axes`` with its TP axis replaced by rank ``rank`` of ``size`` along ``split_dim``
    (added when absent)."""
    tp = Axis("tp", rank, size, split_dim, None, None)
    return [a for a in axes if a.kind != "tp"] + [tp]


def writer_spec(obj: Any, ndim: int) -> tuple[int, int, int] | None:
    """(rank, size, split_dim) of a writer partition (any object with those attributes),
    or None when it is incomplete or out of range for an ``ndim``-dim tensor."""
    try:
        rank, size, dim = int(obj.rank), int(obj.size), int(obj.split_dim)
    except (AttributeError, TypeError, ValueError):
        return None
    if size <= 0 or not 0 <= rank < size or not 0 <= dim < ndim:
        return None
    return rank, size, dim


def writer_key(key: str, rank: int, size: int, dim: int) -> str:
    return f"{key}__writer_{rank}of{size}_sd{dim}"


def manifest(dtype: int, shape: tuple[int, ...], split_dim: int, count: int) -> bytes:
    pad = (tuple(shape) + (-1,) * 8)[:8]
    return _MANIFEST.pack(_MANIFEST_MAGIC, 1, _MANIFEST.size, dtype, len(shape), split_dim,
                          count, 0, *pad)


def parse_manifest(data: bytes) -> tuple[int, tuple[int, ...], int, int] | None:
    """(dtype, global shape, split dim, shard count), or None when not a manifest."""
    if len(data) < _MANIFEST.size:
        return None
    magic, ver, hsize, dtype, ndim, dim, count, _r, *shape = _MANIFEST.unpack_from(data)
    if (magic, ver, hsize) != (_MANIFEST_MAGIC, 1, _MANIFEST.size) or not 0 < ndim <= 8 \
            or count <= 0 or not 0 <= dim < ndim:
        return None
    return dtype, tuple(shape[:ndim]), dim, count


# -- byte-level slicing of C-order data (dtype-agnostic) -----------------------------


def itemsize(dtype: int) -> int:
    return np.dtype(_tensor._DTYPES[dtype][1]).itemsize


def _view(raw: Any, shape: tuple[int, ...], dim: int, isz: int) -> np.ndarray:
    """``raw`` as uint8 [outer, shape[dim], inner bytes]."""
    outer = int(np.prod(shape[:dim], dtype=np.int64))
    inner = int(np.prod(shape[dim + 1:], dtype=np.int64)) * isz
    return np.frombuffer(raw, dtype=np.uint8).reshape(outer, shape[dim], inner)


def slice_dim(raw: Any, shape: tuple[int, ...], dim: int, lo: int, hi: int, isz: int
              ) -> tuple[bytes, tuple[int, ...]]:
    """Elements ``[lo, hi)`` along ``dim``: (C-order bytes, shape)."""
    sub = shape[:dim] + (hi - lo,) + shape[dim + 1:]
    if int(np.prod(sub, dtype=np.int64)) == 0:
        return b"", sub
    return np.ascontiguousarray(_view(raw, shape, dim, isz)[:, lo:hi, :]).tobytes(), sub


def concat_dim(parts: list[tuple[Any, tuple[int, ...]]], dim: int, isz: int
               ) -> tuple[bytes, tuple[int, ...]]:
    """The pieces joined along ``dim``: (C-order bytes, shape)."""
    shape = parts[0][1]
    total = sum(s[dim] for _, s in parts)
    out_shape = shape[:dim] + (total,) + shape[dim + 1:]
    if int(np.prod(out_shape, dtype=np.int64)) == 0:
        return b"", out_shape
    views = [_view(r, s, dim, isz) for r, s in parts]
    return np.concatenate(views, axis=1).tobytes(), out_shape
