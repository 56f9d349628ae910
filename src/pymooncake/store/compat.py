"""``MooncakeDistributedStore``: Mooncake's Python store class, on pymooncake.

Method names, argument order and return conventions follow Mooncake's
``mooncake.store.MooncakeDistributedStore`` (wheel ``mooncake-transfer-engine-non-cuda``
0.3.13.post1; ../shared/MOONCAKE.md "Store"): ints are Mooncake's ``ErrorCode`` numbers
(0 = OK, negative = error), ``get`` returns ``b''`` for a missing key, ``is_exist`` returns
1/0/-1. Code written against Mooncake runs unchanged. Every place where pymooncake behaves
differently is listed in docs/store.md ("Differences from Mooncake").
"""

from __future__ import annotations

import enum
import json
import os
import struct
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from pymooncake.store.client import StoreClient
from pymooncake.store.config import MAX_SOFT_PIN_TTL_MS
from pymooncake.store.config import ReplicateConfig as _TypedReplicateConfig
from pymooncake.store.errors import ErrorCode, StoreError

__all__ = ["BufferHandle", "MooncakeDistributedStore", "ReplicaStatus", "ReplicateConfig",
           "SoftPinAction"]

_OK = int(ErrorCode.OK)
_INVALID_PARAMS = int(ErrorCode.INVALID_PARAMS)
_NOT_FOUND = int(ErrorCode.OBJECT_NOT_FOUND)


class SoftPinAction(enum.IntEnum):
    """Mooncake's soft-pin choice for a put: keep the default (no pin for a new object),
    pin (with ``soft_pin_ttl_ms`` or the master's default), or no pin."""

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ReplicaStatus(enum.IntEnum):
    """Mooncake's replica states (pymooncake's master uses PROCESSING and COMPLETE)."""

    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class ReplicateConfig:
    """Mooncake's mutable ``ReplicateConfig`` (attributes set after construction)."""

    def __init__(self) -> None:
        self.replica_num: int = 1
        self.with_hard_pin: bool = False
        self.preferred_segment: str = ""
        self.soft_pin_action: SoftPinAction = SoftPinAction.PRESERVE
        self.soft_pin_ttl_ms: int | None = None

    @property
    def with_soft_pin(self) -> bool:  # older Mooncake attribute
        return self.soft_pin_action == SoftPinAction.ENABLE

    @with_soft_pin.setter
    def with_soft_pin(self, value: bool) -> None:
        self.soft_pin_action = SoftPinAction.ENABLE if value else SoftPinAction.DISABLE

    def to_typed(self) -> _TypedReplicateConfig:
        """The typed config; raises ``ValueError`` where Mooncake returns -600."""
        ttl = self.soft_pin_ttl_ms
        if ttl is not None and self.soft_pin_action != SoftPinAction.ENABLE:
            raise ValueError("soft_pin_ttl_ms is only valid with SoftPinAction.ENABLE")
        if ttl is not None and not 0 < ttl <= MAX_SOFT_PIN_TTL_MS:
            raise ValueError(f"soft_pin_ttl_ms={ttl}: must be in (0, 24 h]")
        return _TypedReplicateConfig(
            replica_num=self.replica_num, hard_pin=bool(self.with_hard_pin),
            soft_pin=self.soft_pin_action == SoftPinAction.ENABLE,
            soft_pin_ttl_ms=None if ttl is None else float(ttl),
            preferred_segment=self.preferred_segment or "")

    def __repr__(self) -> str:
        return (f"ReplicateConfig(replica_num={self.replica_num}, with_hard_pin="
                f"{self.with_hard_pin}, preferred_segment={self.preferred_segment!r}, "
                f"soft_pin_action={self.soft_pin_action.name}, "
                f"soft_pin_ttl_ms={self.soft_pin_ttl_ms})")


class BufferHandle(np.ndarray):
    """Bytes of one object in registered memory: ``ptr()``, ``size()``, buffer protocol."""

    def ptr(self) -> int:
        return int(self.ctypes.data)

    def size(self) -> int:  # type: ignore[override]
        return int(self.nbytes)


def _parse_size(value: Any, name: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: expected bytes")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name}={value}: must be >= 0")
        return value
    if isinstance(value, str):
        t = value.strip().upper()
        if t.endswith("%"):
            raise ValueError(f"{name}={value!r}: a percentage is not accepted")
        for suffix, mult in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10), ("B", 1)):
            if t.endswith(suffix):
                return int(float(t[: -len(suffix)]) * mult)
        return int(t)
    raise ValueError(f"{name}={value!r}: expected an int or a size string like '16MB'")


def _code(e: Exception) -> int:
    if isinstance(e, StoreError):
        # Mooncake's Python API answers -600 for an empty or oversized key
        return _INVALID_PARAMS if e.code == ErrorCode.INVALID_KEY else int(e.code)
    if isinstance(e, ValueError | TypeError):
        return _INVALID_PARAMS
    return int(ErrorCode.INTERNAL_ERROR)


_TENSOR_MAGIC = b"PMT1"


def _tensor_bytes(tensor: Any) -> bytes:
    """Header (magic, u32 length, JSON dtype+shape) then the raw bytes, C order."""
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


def _tensor_from(data: bytes) -> Any:
    if len(data) < 8 or data[:4] != _TENSOR_MAGIC:
        return None
    (n,) = struct.unpack("<I", data[4:8])
    meta = json.loads(data[8:8 + n])
    raw = data[8 + n:]
    torch = sys.modules.get("torch")
    if meta.get("kind") == "torch" and torch is not None:
        dt = getattr(torch, meta["dtype"])
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else \
            torch.empty(0, dtype=torch.uint8)
        return flat.view(dt).reshape(meta["shape"])
    return np.frombuffer(raw, dtype=np.dtype(meta["dtype"])).reshape(meta["shape"]).copy()


class MooncakeDistributedStore:
    """Mooncake's store class. Call ``setup(...)`` (or ``init_all``) first; every method
    returns Mooncake's codes and never raises for store errors."""

    def __init__(self) -> None:
        self._client: StoreClient | None = None
        self._hostname = ""
        self._local_buffer_size = 0

    # -- lifecycle ---------------------------------------------------------------------

    def setup(self, local_hostname: Any, metadata_server: str = "",
              global_segment_size: Any = 16 << 20, local_buffer_size: Any = 16 << 20,
              protocol: str = "tcp", rdma_devices: str = "",
              master_server_addr: str = "127.0.0.1:50051", engine: Any = None,
              enable_ssd_offload: bool = False, ssd_offload_path: str = "",
              **_ignored: Any) -> int:
        """Connect: Mooncake's positional arguments, or one config dict. 0 on success."""
        if isinstance(local_hostname, dict):
            cfg = dict(local_hostname)
            try:
                return self.setup(
                    cfg["local_hostname"], cfg["metadata_server"],
                    _parse_size(cfg.get("global_segment_size", 16 << 20),
                                "global_segment_size"),
                    _parse_size(cfg.get("local_buffer_size", 16 << 20), "local_buffer_size"),
                    cfg.get("protocol", "tcp"), cfg.get("rdma_devices", ""),
                    cfg.get("master_server_addr", cfg.get("master_server_address",
                                                          "127.0.0.1:50051")),
                    enable_ssd_offload=bool(cfg.get("enable_ssd_offload", False)),
                    ssd_offload_path=cfg.get("ssd_offload_path", ""))
            except (KeyError, ValueError):
                return _INVALID_PARAMS
        if self._client is not None:
            return _OK
        try:
            gseg = _parse_size(global_segment_size, "global_segment_size")
            lbuf = _parse_size(local_buffer_size, "local_buffer_size")
            if protocol not in ("tcp", "rdma", ""):
                raise ValueError(f"protocol={protocol!r}")
            host = str(local_hostname).rpartition(":")[0] if ":" in str(local_hostname) \
                else str(local_hostname)
            host = "127.0.0.1" if host in ("", "localhost") else host
            if metadata_server in ("", "P2PHANDSHAKE"):
                raise ValueError("metadata_server: pymooncake needs a metadata service URL "
                                 "(http://h:p/metadata or etcd://h:p)")
            ssd_path = (ssd_offload_path or os.environ.get("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH")
                        ) if enable_ssd_offload else None
            client = StoreClient(master_server_addr, metadata_server, local_hostname=host,
                                 global_segment_size=gseg, local_buffer_size=lbuf,
                                 ssd_path=ssd_path or None,
                                 ssd_capacity=gseg * 4 if ssd_path else 0)
            client.start()
        except (StoreError, ValueError, OSError, Exception) as e:  # noqa: BLE001
            return _code(e) if isinstance(e, StoreError | ValueError) else int(
                ErrorCode.INTERNAL_ERROR)
        self._client = client
        tcp_port = getattr(getattr(client._dp, "engine", None), "tcp_port", 0)
        name = str(local_hostname)
        self._hostname = name if ":" in name else f"{name}:{tcp_port}"
        self._local_buffer_size = lbuf
        return _OK

    def init_all(self, protocol: str, device_name: str, mount_segment_size: int = 16 << 20
                 ) -> int:
        """Mooncake's older entry point: ``setup`` with addresses from the environment
        (``MOONCAKE_MASTER``, ``MOONCAKE_TE_META_DATA_SERVER``, ``MOONCAKE_LOCAL_HOSTNAME``)."""
        return self.setup(os.environ.get("MOONCAKE_LOCAL_HOSTNAME", "localhost"),
                          os.environ.get("MOONCAKE_TE_META_DATA_SERVER",
                                         "http://127.0.0.1:8080/metadata"),
                          mount_segment_size, 16 << 20, protocol, device_name,
                          os.environ.get("MOONCAKE_MASTER", "127.0.0.1:50051"))

    def close(self) -> int:
        if self._client is not None:
            self._client.close()
            self._client = None
        return _OK

    def health_check(self) -> int:
        """0 healthy, 1 not initialised, 2 master unreachable."""
        if self._client is None:
            return 1
        return 0 if self._client.ping() else 2

    def get_hostname(self) -> str:
        return self._hostname

    @property
    def client(self) -> StoreClient:
        """The typed client underneath (pymooncake extension)."""
        if self._client is None:
            raise StoreError(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS, "call setup() first")
        return self._client

    # -- put ---------------------------------------------------------------------------

    @staticmethod
    def _cfg(config: ReplicateConfig | None) -> _TypedReplicateConfig:
        return (config or ReplicateConfig()).to_typed()

    @staticmethod
    def _put_code(e: StoreError | None) -> int:
        if e is None or e.code == ErrorCode.OBJECT_ALREADY_EXISTS:
            return _OK  # Mooncake: a put of an existing key returns 0 and keeps the value
        return _code(e)

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        return self.put_batch([key], [value], config)

    def put_batch(self, keys: Sequence[str], values: Sequence[Any],
                  config: ReplicateConfig | None = None) -> int:
        """0 when every put succeeded, else the first error code. Values go through the
        local buffer: one larger than ``local_buffer_size`` is -600 (as Mooncake)."""
        try:
            cfg = self._cfg(config)
            for v in values:
                n = memoryview(v).nbytes if isinstance(v, bytes | bytearray | memoryview) else 0
                if n > self._local_buffer_size:
                    return _INVALID_PARAMS
            errs = self.client.batch_put(list(keys), list(values), cfg)
        except Exception as e:  # noqa: BLE001
            return _code(e)
        return next((c for c in map(self._put_code, errs) if c != _OK), _OK)

    def put_from(self, key: str, buffer_ptr: int, size: int,
                 config: ReplicateConfig | None = None) -> int:
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                       sizes: Sequence[int], config: ReplicateConfig | None = None
                       ) -> list[int]:
        try:
            errs = self.client.batch_put_from(list(keys), list(buffer_ptrs), list(sizes),
                                              self._cfg(config))
        except Exception as e:  # noqa: BLE001
            return [_code(e)] * len(keys)
        return [self._put_code(e) for e in errs]

    def put_tensor(self, key: str, tensor: Any) -> int:
        try:
            return self.put(key, _tensor_bytes(tensor))
        except (TypeError, ValueError):
            return _INVALID_PARAMS

    def batch_put_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any]) -> list[int]:
        if len(keys) != len(tensors_list):
            return [_INVALID_PARAMS] * len(keys)
        return [self.put_tensor(k, t) for k, t in zip(keys, tensors_list, strict=True)]

    # -- get ---------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        """The value, or ``b''`` when missing or on any error (as Mooncake)."""
        return self.get_batch([key])[0]

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        if self._local_buffer_size == 0:
            return [b""] * len(keys)  # Mooncake reads through the local buffer
        try:
            vals = self.client.batch_get(list(keys))
        except Exception:  # noqa: BLE001
            return [b""] * len(keys)
        return [b"" if isinstance(v, StoreError) else v for v in vals]

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The object's bytes in a registered buffer (``ptr()``, ``size()``), or None."""
        try:
            size = self.client.get_size(key)
            arr = np.empty(size, dtype=np.uint8)
            addr = self.client.register_buffer(arr)
            try:
                self.client.get_into(key, addr, size)
            finally:
                self.client.unregister_buffer(addr)
        except Exception:  # noqa: BLE001
            return None
        return arr.view(BufferHandle)

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Bytes read, -600 when the buffer is too small, -704 when missing."""
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                       sizes: Sequence[int]) -> list[int]:
        try:
            vals = self.client.batch_get_into(list(keys), list(buffer_ptrs), list(sizes))
        except Exception as e:  # noqa: BLE001
            return [_code(e)] * len(keys)
        return [int(v.code) if isinstance(v, StoreError) else int(v) for v in vals]

    def get_tensor(self, key: str) -> Any:
        """The tensor (torch when torch is loaded, else numpy), or None when missing."""
        data = self.get(key)
        return _tensor_from(data) if data else None

    def batch_get_tensor(self, keys: Sequence[str]) -> list[Any]:
        return [_tensor_from(d) if d else None for d in self.get_batch(keys)]

    # -- memory ------------------------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        try:
            self.client.register_memory(int(buffer_ptr), int(size))
        except Exception as e:  # noqa: BLE001
            return _code(e)
        return _OK

    def unregister_buffer(self, buffer_ptr: int) -> int:
        try:
            self.client.unregister_buffer(int(buffer_ptr))
        except Exception as e:  # noqa: BLE001
            return _code(e)
        return _OK

    # -- metadata ----------------------------------------------------------------------

    def is_exist(self, key: str) -> int:
        """1 present, 0 absent, -1 error."""
        try:
            return 1 if self.client.exist(key) else 0
        except Exception:  # noqa: BLE001
            return -1

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        try:
            vals = self.client.batch_exist(list(keys))
        except Exception:  # noqa: BLE001
            return [-1] * len(keys)
        return [-1 if isinstance(v, StoreError) else int(bool(v)) for v in vals]

    def get_size(self, key: str) -> int:
        try:
            return self.client.get_size(key)
        except Exception as e:  # noqa: BLE001
            return _code(e)

    def remove(self, key: str, force: bool = False) -> int:
        """0; -706 while a read lease is held (unless ``force``); -704 when missing."""
        try:
            self.client.remove(key, force)
        except Exception as e:  # noqa: BLE001
            return _code(e)
        return _OK

    def remove_all(self, force: bool = False) -> int:
        """Number of objects removed (or a negative code)."""
        try:
            return self.client.remove_all(force)
        except Exception as e:  # noqa: BLE001
            return _code(e)
