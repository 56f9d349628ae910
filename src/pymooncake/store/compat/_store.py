"""``MooncakeDistributedStore`` on pymooncake: lifecycle, put/upsert/get, zero copy,
metadata and remove calls with Mooncake's argument order and return codes."""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import re
import socket
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pymooncake.store.client import StoreClient
from pymooncake.store.compat._tensor_api import TensorMethods
from pymooncake.store.compat._types import (
    BufferHandle,
    Descriptor,
    DiskDescriptor,
    MemoryDescriptor,
    ReplicaDescriptor,
    ReplicaStatus,
    ReplicateConfig,
)
from pymooncake.store.config import ReplicateConfig as _TypedReplicateConfig
from pymooncake.store.errors import ErrorCode, StoreError
from pymooncake.store.protocol import TIER_DRAM

_OK = int(ErrorCode.OK)
_INVALID_PARAMS = int(ErrorCode.INVALID_PARAMS)
_NOT_FOUND = int(ErrorCode.OBJECT_NOT_FOUND)
_EXISTS = ErrorCode.OBJECT_ALREADY_EXISTS
_PORT_RANGE = (12300, 14300)  # Mooncake's range for a client's transfer port


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


def _code(e: BaseException) -> int:
    if isinstance(e, StoreError):
        # Mooncake's Python API answers -600 for an empty or oversized key
        return _INVALID_PARAMS if e.code == ErrorCode.INVALID_KEY else int(e.code)
    if isinstance(e, ValueError | TypeError):
        return _INVALID_PARAMS
    return int(ErrorCode.INTERNAL_ERROR)


def _put_code(e: StoreError | None) -> int:
    if e is None or e.code == _EXISTS:
        return _OK  # Mooncake: a put of an existing key returns 0 and keeps the value
    return _code(e)


def _free_port() -> int:
    """A TCP port in Mooncake's range that is free now (the engine binds it next)."""
    lo, hi = _PORT_RANGE
    for port in random.sample(range(lo, hi), 64):
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    return 0


def _buffer_nbytes(value: Any) -> int:
    """Bytes in a buffer-protocol value; ``TypeError`` for anything else (as pybind's
    ``Buffer`` argument: a ``str`` is refused)."""
    try:
        return memoryview(value).nbytes
    except TypeError:
        raise TypeError(f"value must support the buffer protocol, got "
                        f"{type(value).__name__}") from None


class MooncakeDistributedStore(TensorMethods):
    """Mooncake's store class. Call ``setup(...)`` (or ``init_all``) first; store errors are
    returned as Mooncake's codes, never raised (a value of the wrong Python type raises
    ``TypeError``, as pybind11 does)."""

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
        """Connect: Mooncake's positional arguments, or one config dict. 0 on success.
        The segment is named ``host:port`` after the Transfer Engine's TCP port (the
        port given in ``local_hostname``, else a free one in 12300–14300), which is
        ``get_hostname()`` and every replica's ``transport_endpoint``, as in Mooncake."""
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
            name = str(local_hostname)
            host, sep, port_s = name.rpartition(":")
            if not sep or not port_s.isdigit():
                host, port = name, _free_port()
            else:
                port = int(port_s)
            bind_host = "127.0.0.1" if host in ("", "localhost") else host
            if metadata_server in ("", "P2PHANDSHAKE"):
                raise ValueError("metadata_server: pymooncake needs a metadata service URL "
                                 "(http://h:p/metadata or etcd://h:p)")
            ssd_path = (ssd_offload_path or os.environ.get("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH")
                        ) if enable_ssd_offload else None
            from pymooncake.transfer import TransferConfig

            client = StoreClient(master_server_addr, metadata_server, local_hostname=bind_host,
                                 global_segment_size=gseg, local_buffer_size=lbuf,
                                 ssd_path=ssd_path or None,
                                 ssd_capacity=gseg * 4 if ssd_path else 0,
                                 transfer_config=TransferConfig(tcp_port=port),
                                 name=f"{host or bind_host}:{port}" if port else None)
            client.start()
        except Exception as e:  # noqa: BLE001
            return _code(e) if isinstance(e, StoreError | ValueError) else int(
                ErrorCode.INTERNAL_ERROR)
        self._client = client
        tcp_port = getattr(getattr(client._dp, "engine", None), "tcp_port", port)
        self._hostname = f"{host or bind_host}:{tcp_port}"
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
        """Unmount this client's segment (objects whose only replica lived there are gone)
        and stop. Later calls answer as before ``setup`` (``get`` → ``b''``)."""
        if self._client is not None:
            self._client.close()
            self._client = None
        return _OK

    def health_check(self) -> int:
        """0 healthy, 1 not initialised (or closed), 2 master unreachable."""
        if self._client is None:
            return 1
        return 0 if self._client.ping() else 2

    def get_hostname(self) -> str:
        """``host:port`` of this client (its segment name)."""
        return self._hostname

    @property
    def client(self) -> StoreClient:
        """The typed client underneath (pymooncake extension)."""
        if self._client is None:
            raise StoreError(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS, "call setup() first")
        return self._client

    # -- put / upsert ------------------------------------------------------------------

    @staticmethod
    def _cfg(config: ReplicateConfig | None) -> _TypedReplicateConfig:
        if config is not None and not isinstance(config, ReplicateConfig):
            raise TypeError(f"config must be a ReplicateConfig, got {type(config).__name__}")
        return (config or ReplicateConfig()).to_typed()

    def _put_values(self, keys: Sequence[str], values: Sequence[Any],
                    config: ReplicateConfig | None, upsert: bool) -> list[int]:
        """Codes per key. Values go through the local buffer: one larger than
        ``local_buffer_size`` is -600 (as Mooncake). Raises TypeError for bad types."""
        sizes = [_buffer_nbytes(v) for v in values]
        if len(keys) != len(values):
            return [_INVALID_PARAMS] * max(len(keys), 1)
        try:
            cfg = self._cfg(config)
            if any(n > self._local_buffer_size for n in sizes):
                return [_INVALID_PARAMS] * len(keys)
            if upsert:
                return self._upsert(list(keys), lambda ks, ix: self.client.batch_put(
                    ks, [values[i] for i in ix], cfg))
            return [_put_code(e) for e in self.client.batch_put(list(keys), list(values), cfg)]
        except Exception as e:  # noqa: BLE001
            return [_code(e)] * len(keys)

    def _upsert(self, keys: list[str],
                put: Callable[[list[str], list[int]], list[StoreError | None]]) -> list[int]:
        """Insert or replace (the size may change): put; a key that exists is removed
        (forced, leases do not block an upsert) and put again. A reader between the two
        sees a miss, never mixed bytes."""
        out = [_OK] * len(keys)
        todo = list(range(len(keys)))
        for _ in range(3):
            errs = put([keys[i] for i in todo], todo)
            again = []
            for i, e in zip(todo, errs, strict=True):
                if e is not None and e.code == _EXISTS:
                    try:
                        self.client.remove(keys[i], force=True)
                    except StoreError as r:
                        if r.code != ErrorCode.OBJECT_NOT_FOUND:
                            out[i] = _code(r)
                            continue
                    again.append(i)
                else:
                    out[i] = _put_code(e)
            if not again:
                return out
            todo = again
        for i in todo:
            out[i] = int(_EXISTS)  # another writer kept winning the key
        return out

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        return self._put_values([key], [value], config, False)[0]

    def put_batch(self, keys: Sequence[str], values: Sequence[Any],
                  config: ReplicateConfig | None = None) -> int:
        """0 when every put succeeded, else the first error code."""
        return next((c for c in self._put_values(keys, values, config, False) if c), _OK)

    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """The parts, concatenated, as one object. No parts: 0 and nothing stored."""
        if not parts:
            return _OK
        return self.put(key, b"".join(memoryview(p).cast("B") for p in parts), config)

    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Insert or replace ``key`` (its size may change). 0 on success."""
        return self._put_values([key], [value], config, True)[0]

    def upsert_batch(self, keys: Sequence[str], values: Sequence[Any],
                     config: ReplicateConfig | None = None) -> int:
        return next((c for c in self._put_values(keys, values, config, True) if c), _OK)

    def upsert_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None
                     ) -> int:
        if not parts:
            return _OK
        return self.upsert(key, b"".join(memoryview(p).cast("B") for p in parts), config)

    def put_from(self, key: str, buffer_ptr: int, size: int,
                 config: ReplicateConfig | None = None) -> int:
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                       sizes: Sequence[int], config: ReplicateConfig | None = None
                       ) -> list[int]:
        """Zero copy from registered memory; one code per key."""
        try:
            errs = self.client.batch_put_from(list(keys), list(buffer_ptrs), list(sizes),
                                              self._cfg(config))
        except Exception as e:  # noqa: BLE001
            return [_code(e)] * len(keys)
        return [_put_code(e) for e in errs]

    def upsert_from(self, key: str, buffer_ptr: int, size: int,
                    config: ReplicateConfig | None = None) -> int:
        return self.batch_upsert_from([key], [buffer_ptr], [size], config)[0]

    def batch_upsert_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                          sizes: Sequence[int], config: ReplicateConfig | None = None
                          ) -> list[int]:
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [_INVALID_PARAMS] * len(keys)
        try:
            cfg = self._cfg(config)
            return self._upsert(list(keys), lambda ks, ix: self.client.batch_put_from(
                ks, [buffer_ptrs[i] for i in ix], [sizes[i] for i in ix], cfg))
        except Exception as e:  # noqa: BLE001
            return [_code(e)] * len(keys)

    def batch_put_from_multi_buffers(self, keys: Sequence[str],
                                     all_buffer_ptrs: Sequence[Sequence[int]],
                                     all_sizes: Sequence[Sequence[int]],
                                     config: ReplicateConfig | None = None) -> list[int]:
        """Each object is the concatenation of its registered pieces; one code per key."""
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes):
            return [_INVALID_PARAMS] * len(keys)
        try:
            cfg = self._cfg(config)
            c = self.client
            out = [_OK] * len(keys)
            idx, vals = [], []
            for i, (ptrs, sizes) in enumerate(zip(all_buffer_ptrs, all_sizes, strict=True)):
                if (len(ptrs) != len(sizes) or not ptrs or any(s <= 0 for s in sizes)
                        or not all(c._in_registered(p, s) for p, s in zip(ptrs, sizes,
                                                                           strict=True))):
                    out[i] = _INVALID_PARAMS
                    continue
                idx.append(i)
                vals.append(b"".join(ctypes.string_at(p, s) for p, s in zip(ptrs, sizes,
                                                                             strict=True)))
            errs = c.batch_put([keys[i] for i in idx], vals, cfg) if idx else []
            for i, e in zip(idx, errs, strict=True):
                out[i] = _put_code(e)
            return out
        except Exception as e:  # noqa: BLE001
            return [_code(e)] * len(keys)

    # -- get ---------------------------------------------------------------------------

    def _values(self, keys: Sequence[str]) -> list[bytes | int]:
        """The bytes of each key, or its error code (reads go through the local buffer,
        so a client with ``local_buffer_size=0`` reads nothing, as Mooncake)."""
        if self._local_buffer_size == 0:
            return [_INVALID_PARAMS] * len(keys)
        try:
            vals = self.client.batch_get(list(keys))
        except Exception as e:  # noqa: BLE001
            return [_code(e)] * len(keys)
        return [_code(v) if isinstance(v, StoreError) else v for v in vals]

    def get(self, key: str) -> bytes:
        """The value, or ``b''`` when missing or on any error (as Mooncake)."""
        return self.get_batch([key])[0]

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        return [v if isinstance(v, bytes) else b"" for v in self._values(keys)]

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The object's bytes in a buffer this process owns (``ptr()``, ``size()``,
        buffer protocol), or None."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: Sequence[str]) -> list[BufferHandle | None]:
        return [np.frombuffer(bytearray(v), dtype=np.uint8).view(BufferHandle)
                if isinstance(v, bytes) else None for v in self._values(keys)]

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Bytes read, -600 when the buffer is too small, -704 when missing."""
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                       sizes: Sequence[int]) -> list[int]:
        try:
            vals = self.client.batch_get_into(list(keys), list(buffer_ptrs), list(sizes))
        except Exception as e:  # noqa: BLE001
            return [_code(e)] * len(keys)
        return [_code(v) if isinstance(v, StoreError) else int(v) for v in vals]

    def batch_get_into_multi_buffers(self, keys: Sequence[str],
                                     all_buffer_ptrs: Sequence[Sequence[int]],
                                     all_sizes: Sequence[Sequence[int]],
                                     prefer_alloc_in_same_node: bool = False) -> list[int]:
        """Each object scattered over its registered buffers in order; the object's size
        per key, -600 when the buffers hold less, -704 when missing."""
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes):
            return [_INVALID_PARAMS] * len(keys)
        out: list[int] = []
        for v, ptrs, sizes in zip(self._values(keys), all_buffer_ptrs, all_sizes,
                                  strict=True):
            if not isinstance(v, bytes):
                out.append(v)
                continue
            if (len(ptrs) != len(sizes) or sum(sizes) < len(v)
                    or not all(self.client._in_registered(p, s) for p, s in zip(
                        ptrs, sizes, strict=True) if s > 0)):
                out.append(_INVALID_PARAMS)
                continue
            off = 0
            for p, s in zip(ptrs, sizes, strict=True):
                n = min(s, len(v) - off)
                if n <= 0:
                    break
                ctypes.memmove(p, v[off:off + n], n)
                off += n
            out.append(len(v))
        return out

    def get_into_ranges(self, buffer_ptrs: Sequence[int], all_keys: Sequence[Sequence[str]],
                        all_dst_offsets: Sequence[Sequence[Sequence[int]]],
                        all_src_offsets: Sequence[Sequence[Sequence[int]]],
                        all_sizes: Sequence[Sequence[Sequence[int]]]
                        ) -> list[list[list[int]]]:
        """For buffer ``i`` and its key ``j``, copy object bytes ``[src, src+size)`` to
        ``buffer_ptrs[i] + dst`` for each range; bytes copied per range, or a code
        (-704 missing, -600 out of the object or of registered memory)."""
        uniq = list(dict.fromkeys(k for ks in all_keys for k in ks))
        got = dict(zip(uniq, self._values(uniq), strict=True)) if uniq else {}
        out: list[list[list[int]]] = []
        for base, keys, dsts, srcs, sizes in zip(buffer_ptrs, all_keys, all_dst_offsets,
                                                 all_src_offsets, all_sizes, strict=True):
            per_key = []
            for k, d_l, s_l, n_l in zip(keys, dsts, srcs, sizes, strict=True):
                v = got[k]
                codes = []
                for d, s, n in zip(d_l, s_l, n_l, strict=True):
                    if not isinstance(v, bytes):
                        codes.append(v)
                    elif (n < 0 or s < 0 or d < 0 or s + n > len(v)
                          or not self.client._in_registered(base + d, max(n, 1))):
                        codes.append(_INVALID_PARAMS)
                    else:
                        ctypes.memmove(base + d, v[s:s + n], n)
                        codes.append(n)
                per_key.append(codes)
            out.append(per_key)
        return out

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

    def get_replica_desc(self, key: str) -> list[ReplicaDescriptor]:
        """The object's replicas (``[]`` when missing); grants a read lease, as Mooncake's
        ``GetReplicaList``."""
        try:
            rl = self.client.replica_list(key)
        except Exception:  # noqa: BLE001
            return []
        out = []
        for r in rl.replicas:
            status = ReplicaStatus.__members__.get(r.status, ReplicaStatus.COMPLETE)
            if r.tier == TIER_DRAM:
                out.append(ReplicaDescriptor(status, mem=MemoryDescriptor(
                    Descriptor(r.addr, r.length, r.segment))))
            else:
                out.append(ReplicaDescriptor(status, disk=DiskDescriptor(
                    f"{r.segment}/{r.tier}/{key}", r.length)))
        return out

    def batch_get_replica_desc(self, keys: Sequence[str]) -> dict[str, list[ReplicaDescriptor]]:
        """Key → replicas, for the keys that exist."""
        out = {}
        for k in keys:
            d = self.get_replica_desc(k)
            if d:
                out[k] = d
        return out

    # -- remove ------------------------------------------------------------------------

    def remove(self, key: str, force: bool = False) -> int:
        """0; -706 while a read lease is held (unless ``force``); -704 when missing."""
        try:
            self.client.remove(key, force)
        except Exception as e:  # noqa: BLE001
            return _code(e)
        return _OK

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        return [self.remove(k, force) for k in keys]

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """Removes every key the pattern matches (searched anywhere in the key); the count,
        or -600 for a pattern that does not compile. Leased keys stay unless ``force``."""
        try:
            rx = re.compile(regex_pattern)
            keys = self.client.list_keys()
        except re.error:
            return _INVALID_PARAMS
        except Exception as e:  # noqa: BLE001
            return _code(e)
        return sum(self.remove(k, force) == _OK for k in keys if rx.search(k))

    def remove_all(self, force: bool = False) -> int:
        """Number of objects removed (or a negative code)."""
        try:
            return self.client.remove_all(force)
        except Exception as e:  # noqa: BLE001
            return _code(e)

    def batch_replica_clear(self, keys: Sequence[str], segment_name: str = "") -> list[str]:
        """Drops the replicas of keys whose lease has lapsed; the keys cleared. With a
        ``segment_name``, only a key whose every replica lies on that segment is cleared
        (pymooncake's master cannot drop one replica of several)."""
        cleared = []
        for k in keys:
            if segment_name:
                descs = self.get_replica_desc(k)
                with contextlib.suppress(Exception):
                    self.client.release_leases([k])  # ours, taken just now
                if not descs or any(d.is_memory_replica() and d.get_memory_descriptor()
                                    .buffer_descriptor.transport_endpoint != segment_name
                                    for d in descs):
                    continue
            if self.remove(k) == _OK:
                cleared.append(k)
        return cleared
