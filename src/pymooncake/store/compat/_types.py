"""Mooncake's store value types: enums, ``ReplicateConfig``, replica descriptors, buffer
handles. Attribute types are checked as pybind11 checks them (a wrong type raises
``TypeError``), observed on ``mooncake-transfer-engine-non-cuda`` 0.3.13.post1."""

from __future__ import annotations

import enum
import functools
import inspect
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from pymooncake.store.config import MAX_SOFT_PIN_TTL_MS
from pymooncake.store.config import ReplicateConfig as _TypedReplicateConfig


class _Enum(enum.IntEnum):
    """An int enum whose ``str`` is ``Class.MEMBER``, as pybind11's enums."""

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class SoftPinAction(_Enum):
    """Soft pin for a put: keep the default (no pin for a new object), pin (with
    ``soft_pin_ttl_ms`` or the master's default), or no pin."""

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ReplicaStatus(_Enum):
    """Mooncake's replica states (pymooncake's master uses PROCESSING and COMPLETE)."""

    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class ObjectDataType(_Enum):
    """What an object holds (a hint carried by ``ReplicateConfig.data_type``)."""

    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


class TaskStatus(_Enum):
    """State of a copy/move task (Mooncake's numbering: FAILED is 2, SUCCESS 3)."""

    PENDING = 0
    PROCESSING = 1
    FAILED = 2
    SUCCESS = 3


class TaskType(_Enum):
    REPLICA_COPY = 0
    REPLICA_MOVE = 1


def incompatible(func: str, what: str, value: Any, expected: str) -> TypeError:
    """pybind11's answer to an argument of the wrong Python type: ``TypeError`` saying
    ``<func>(): incompatible function arguments``, what took it, what it takes and what
    it got."""
    return TypeError(f"{func}(): incompatible function arguments: {what} takes {expected}, "
                     f"got {value!r}")


def _bad(field: str, value: Any, expected: str) -> TypeError:
    return incompatible("", f"ReplicateConfig.{field}", value, expected)


_KEY = "str (or bytes: std::string)"


def key_arg(func: str, value: Any) -> str:
    """A key as pybind's ``std::string`` takes it: ``str``, or ``bytes`` (decoded as UTF-8,
    so ``b"k"`` and ``"k"`` name one object); anything else raises ``TypeError``."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "surrogateescape")
    raise incompatible(func, "key", value, _KEY)


def keys_arg(func: str, value: Any, name: str = "keys") -> list[str]:
    """Keys as ``std::vector<std::string>``: a list or tuple of str/bytes, else
    ``TypeError``."""
    if type(value) is list or type(value) is tuple:
        try:  # every item a str (the usual case): one C-level pass, no per-key calls
            "".join(value)
        except TypeError:
            pass
        else:
            return list(value)
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise incompatible(func, name, value, f"a list of {_KEY}")
    out = []
    for v in value:
        if not isinstance(v, str | bytes):
            raise incompatible(func, f"{name}[{len(out)}]", v, _KEY)
        out.append(key_arg(func, v))
    return out


def typed_keys(cls: type) -> type:
    """Class decorator: every public method whose first argument is ``key``, ``keys`` or
    ``base_keys`` checks and converts it as pybind11 does (``key_arg``/``keys_arg``)
    before running; ``None`` passes where it is the default (``key=py::none()``)."""
    for name, fn in inspect.getmembers(cls, inspect.isfunction):
        if name.startswith("_"):
            continue
        params = list(inspect.signature(fn).parameters.values())[1:2]
        if not params or params[0].name not in ("key", "keys", "base_keys"):
            continue
        setattr(cls, name, _wrap_key(fn, name, params[0].name, params[0].default is None))
    return cls


def _wrap_key(fn: Any, name: str, param: str, none_ok: bool) -> Any:
    conv = key_arg if param == "key" else functools.partial(keys_arg, name=param)

    def check(v: Any) -> Any:
        return v if v is None and none_ok else conv(name, v)

    str_passes = param == "key"   # a str key is already what key_arg returns

    @functools.wraps(fn)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if args:
            if not (str_passes and type(args[0]) is str):  # the hot path: no call
                args = (check(args[0]), *args[1:])
        elif param in kwargs:
            kwargs[param] = check(kwargs[param])
        return fn(self, *args, **kwargs)
    return method


def _size_t(field: str, v: Any) -> int:
    if isinstance(v, float | str | bytes) or v is None:
        raise _bad(field, v, "int >= 0")
    try:
        n = operator.index(v)
    except TypeError:
        raise _bad(field, v, "int >= 0") from None
    if n < 0:
        raise _bad(field, v, "int >= 0")
    return n


def bool_arg(func: str, what: str, v: Any) -> bool:
    """A ``bool`` parameter as pybind11 converts it: ``None`` and numbers (``1`` is
    ``True``) by their truth value; anything else (a ``str``, a list) raises
    ``TypeError`` naming ``func`` and the parameter ``what``."""
    if v is None or isinstance(v, bool | int | float | np.bool_ | np.number):
        return bool(v)
    raise incompatible(func, what, v, "bool")


def _bool(field: str, v: Any) -> bool:
    return bool_arg("", f"ReplicateConfig.{field}", v)


def _str(field: str, v: Any) -> str:
    if not isinstance(v, str):
        raise _bad(field, v, "str")
    return v


def _str_list(field: str, v: Any) -> list[str]:
    if isinstance(v, str | bytes) or not isinstance(v, list | tuple):
        raise _bad(field, v, "list[str]")
    if not all(isinstance(x, str) for x in v):
        raise _bad(field, v, "list[str]")
    return list(v)


def _enum(field: str, v: Any, cls: type[enum.IntEnum]) -> Any:
    if not isinstance(v, cls):
        raise _bad(field, v, cls.__name__)
    return v


_CHECKS: dict[str, Any] = {
    "replica_num": _size_t, "nof_replica_num": _size_t, "dfs_replica_num": _size_t,
    "with_hard_pin": _bool, "prefer_alloc_in_same_node": _bool,
    "preferred_segment": _str,
    "preferred_segments": _str_list, "preferred_nof_segments": _str_list,
    "group_ids": lambda f, v: None if v is None else _str_list(f, v),
    "soft_pin_ttl_ms": lambda f, v: None if v is None else _size_t(f, v),
    "soft_pin_action": lambda f, v: _enum(f, v, SoftPinAction),
    "data_type": lambda f, v: _enum(f, v, ObjectDataType),
}


class ReplicateConfig:
    """Mooncake's mutable ``ReplicateConfig``: built without arguments, fields set after.
    Every field is type-checked on assignment (``TypeError``, as pybind11); unknown
    attributes raise ``AttributeError``. Fields pymooncake's master does not act on
    (``nof_replica_num``, ``dfs_replica_num``, ``preferred_nof_segments``,
    ``prefer_alloc_in_same_node``, ``data_type``, ``group_ids``) are kept and ignored."""

    __slots__ = tuple(f"_{f}" for f in _CHECKS)

    def __init__(self) -> None:
        for f, v in (("replica_num", 1), ("nof_replica_num", 0), ("dfs_replica_num", 0),
                     ("with_hard_pin", False), ("prefer_alloc_in_same_node", False),
                     ("preferred_segment", ""), ("preferred_segments", []),
                     ("preferred_nof_segments", []), ("group_ids", None),
                     ("soft_pin_ttl_ms", None), ("soft_pin_action", SoftPinAction.PRESERVE),
                     ("data_type", ObjectDataType.UNKNOWN)):
            object.__setattr__(self, f"_{f}", v)

    def __setattr__(self, name: str, value: Any) -> None:
        check = _CHECKS.get(name)
        if check is None:
            if name == "with_soft_pin":  # older Mooncake attribute
                value = SoftPinAction.ENABLE if _bool(name, value) else SoftPinAction.DISABLE
                name = "soft_pin_action"
            else:
                raise AttributeError(f"'ReplicateConfig' object has no attribute {name!r}")
        else:
            value = check(name, value)
        object.__setattr__(self, f"_{name}", value)

    def __getattr__(self, name: str) -> Any:
        if name == "with_soft_pin":
            return self.soft_pin_action == SoftPinAction.ENABLE
        if name in _CHECKS:
            v = object.__getattribute__(self, f"_{name}")
            return list(v) if isinstance(v, list) else v
        raise AttributeError(f"'ReplicateConfig' object has no attribute {name!r}")

    def to_typed(self) -> _TypedReplicateConfig:
        """The typed config; raises ``ValueError`` where Mooncake returns -600."""
        ttl = self.soft_pin_ttl_ms
        action = self.soft_pin_action
        if ttl is not None and action != SoftPinAction.ENABLE:
            raise ValueError("soft_pin_ttl_ms is only valid with SoftPinAction.ENABLE")
        if ttl is not None and not 0 < ttl <= MAX_SOFT_PIN_TTL_MS:
            raise ValueError(f"soft_pin_ttl_ms={ttl}: must be in (0, 24 h]")
        preferred = self.preferred_segment or next(iter(self.preferred_segments), "")
        return _TypedReplicateConfig(
            replica_num=self.replica_num, hard_pin=self.with_hard_pin,
            soft_pin=action == SoftPinAction.ENABLE,
            soft_pin_ttl_ms=None if ttl is None else float(ttl), preferred_segment=preferred)

    def __str__(self) -> str:
        ttl = "default" if self.soft_pin_ttl_ms is None else self.soft_pin_ttl_ms
        return (f"ReplicateConfig: {{ replica_num: {self.replica_num}, nof_replica_num: "
                f"{self.nof_replica_num}, dfs_replica_num: {self.dfs_replica_num}, "
                f"soft_pin_action: {self.soft_pin_action.name}, soft_pin_ttl_ms: {ttl}, "
                f"with_hard_pin: {int(self.with_hard_pin)}, preferred_segments: "
                f"[{', '.join(self.preferred_segments)}], preferred_nof_segments: "
                f"[{', '.join(self.preferred_nof_segments)}], prefer_alloc_in_same_node: "
                f"{int(self.prefer_alloc_in_same_node)}, data_type: {self.data_type.name} }}")

    __repr__ = __str__


class BufferHandle(np.ndarray):
    """Bytes of one object in memory this process owns: ``ptr()``, ``size()``, buffer
    protocol (``memoryview(h)``, ``np.asarray(h)``)."""

    def ptr(self) -> int:
        return int(self.ctypes.data)

    def size(self) -> int:  # type: ignore[override]
        return int(self.nbytes)


class Descriptor:
    """A memory replica's location: ``buffer_address``, ``size``, ``transport_endpoint``
    (the segment name, which is the owner's ``get_hostname()`` for compat clients)."""

    __slots__ = ("buffer_address", "size", "transport_endpoint")

    def __init__(self, buffer_address: int = 0, size: int = 0,
                 transport_endpoint: str = "") -> None:
        self.buffer_address, self.size = buffer_address, size
        self.transport_endpoint = transport_endpoint

    def __repr__(self) -> str:
        return (f"Descriptor(buffer_address={self.buffer_address:#x}, size={self.size}, "
                f"transport_endpoint={self.transport_endpoint!r})")


class MemoryDescriptor:
    __slots__ = ("buffer_descriptor",)

    def __init__(self, buffer_descriptor: Descriptor) -> None:
        self.buffer_descriptor = buffer_descriptor


class DiskDescriptor:
    __slots__ = ("file_path", "object_size")

    def __init__(self, file_path: str, object_size: int) -> None:
        self.file_path, self.object_size = file_path, object_size


class ReplicaDescriptor:
    """One replica as ``get_replica_desc`` reports it."""

    __slots__ = ("_mem", "_disk", "status")

    def __init__(self, status: ReplicaStatus, mem: MemoryDescriptor | None = None,
                 disk: DiskDescriptor | None = None) -> None:
        self.status, self._mem, self._disk = status, mem, disk

    def is_memory_replica(self) -> bool:
        return self._mem is not None

    def is_disk_replica(self) -> bool:
        return self._disk is not None

    def is_local_disk_replica(self) -> bool:
        return False  # pymooncake's SSD tier is reported as a disk replica

    def get_memory_descriptor(self) -> MemoryDescriptor:
        if self._mem is None:
            raise RuntimeError("Expected MemoryDescriptor")  # Mooncake's message
        return self._mem

    def get_disk_descriptor(self) -> DiskDescriptor:
        if self._disk is None:
            raise RuntimeError("Expected DiskDescriptor")
        return self._disk

    def __repr__(self) -> str:
        where = (self._mem.buffer_descriptor if self._mem is not None
                 else f"disk {self._disk.file_path!r}" if self._disk is not None else "?")
        return f"ReplicaDescriptor({self.status.name}, {where})"
