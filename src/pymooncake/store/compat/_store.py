"""``MooncakeDistributedStore`` on pymooncake: lifecycle (``setup``, ``setup_dummy``,
``init_all``, ``close``, ``health_check``, ``get_hostname``); the method groups are mixed in
from ``_write``, ``_read``, ``_tensor_api``, ``_tensor_tp``, ``_tensor_parallel`` and
``_tasks``, ``_session`` and ``_segments``."""

from __future__ import annotations

import errno
import os
from typing import Any

from pymooncake.store.client import StoreClient
from pymooncake.store.compat._codes import INVALID_PARAMS, OK, code, free_port, parse_size
from pymooncake.store.compat._read import ReadMethods
from pymooncake.store.compat._segments import SegmentMethods
from pymooncake.store.compat._session import SessionMethods
from pymooncake.store.compat._tasks import TaskMethods
from pymooncake.store.compat._tensor_api import TensorMethods
from pymooncake.store.compat._tensor_parallel import TensorParallelMethods
from pymooncake.store.compat._tensor_tp import TensorTpMethods
from pymooncake.store.compat._types import incompatible, typed_keys
from pymooncake.store.compat._write import WriteMethods
from pymooncake.store.errors import ErrorCode, StoreError

P2P_METADATA_ENV = "PYMOONCAKE_P2P_METADATA_SERVER"
"""Where a store set up with ``metadata_server="P2PHANDSHAKE"`` publishes its segment
(pymooncake's store needs a metadata service); default ``http://<master host>:8080/metadata``,
the master's ``--enable-http-metadata-server``."""


def _p2p_metadata(master: str) -> str:
    url = os.environ.get(P2P_METADATA_ENV)
    if url:
        return url
    host = master.rpartition(":")[0] or "127.0.0.1"
    return f"http://{host}:8080/metadata"


PORT_ATTEMPTS = 8
"""Ports tried when ``setup`` chooses the Transfer Engine's port itself."""


def _port_taken(e: StoreError) -> bool:
    """Whether the engine failed to start because its port was bound by someone else
    (``EADDRINUSE`` behind the ``RPC_FAIL``)."""
    cause = e.__cause__ or e.__context__
    return isinstance(cause, OSError) and cause.errno == errno.EADDRINUSE


@typed_keys
class MooncakeDistributedStore(WriteMethods, ReadMethods, TensorMethods, TensorTpMethods,
                               TensorParallelMethods, TaskMethods, SessionMethods,
                               SegmentMethods):
    """Mooncake's store class. Call ``setup(...)`` (or ``init_all``) first; store errors are
    returned as Mooncake's codes, never raised (a value of the wrong Python type raises
    ``TypeError``, as pybind11 does)."""

    def __init__(self) -> None:
        self._client: StoreClient | None = None
        self._hostname = ""
        self._local_buffer_size = 0
        self._prefer_segment = ""
        self._mem_pool: list[Any] = []
        self._mem_pool_left = 1 << 62  # a real client's pool: bounded by memory only
        TaskMethods.__init__(self)
        self._init_sessions()

    # -- lifecycle ---------------------------------------------------------------------

    def setup(self, local_hostname: Any, metadata_server: str = "",
              global_segment_size: Any = 16 << 20, local_buffer_size: Any = 16 << 20,
              protocol: str = "tcp", rdma_devices: str = "",
              master_server_addr: str = "127.0.0.1:50051", engine: Any = None,
              enable_ssd_offload: bool = False, ssd_offload_path: str = "",
              **_ignored: Any) -> int:
        """Connect: Mooncake's positional arguments, or one config dict. 0 on success.
        A second ``setup`` checks its arguments (a bad size is -600) and keeps the
        connected client (Mooncake replaces it). The segment is named ``host:port``
        after the Transfer Engine's TCP port (the port given in ``local_hostname``, else
        a free one in 12300–14300), which is
        ``get_hostname()`` and every replica's ``transport_endpoint``, as in Mooncake."""
        if isinstance(local_hostname, dict):
            cfg = dict(local_hostname)
            try:
                return self.setup(
                    cfg["local_hostname"], cfg["metadata_server"],
                    parse_size(cfg.get("global_segment_size", 16 << 20),
                               "global_segment_size"),
                    parse_size(cfg.get("local_buffer_size", 16 << 20), "local_buffer_size"),
                    cfg.get("protocol", "tcp"), cfg.get("rdma_devices",
                                                        cfg.get("device_name", "")),
                    cfg.get("master_server_addr", cfg.get("master_server_address",
                                                          "127.0.0.1:50051")),
                    enable_ssd_offload=bool(cfg.get("enable_ssd_offload", False)),
                    ssd_offload_path=cfg.get("ssd_offload_path", ""))
            except (KeyError, ValueError):
                return INVALID_PARAMS
        for what, v in (("local_hostname", local_hostname),
                        ("metadata_server", metadata_server),
                        ("master_server_addr", master_server_addr)):
            if not isinstance(v, str):  # pybind's std::string: a TypeError, not a bind error
                raise incompatible("setup", what, v, "str")
        try:
            gseg = parse_size(global_segment_size, "global_segment_size")
            lbuf = parse_size(local_buffer_size, "local_buffer_size")
            if protocol not in ("tcp", "rdma", ""):
                raise ValueError(f"protocol={protocol!r}")
        except ValueError as e:
            return code(e)
        if self._client is not None:
            # Mooncake builds a new client for a second setup (store_py.cpp,
            # init_real_client); this facade keeps the first one once the new arguments
            # pass the same checks (docs/compat.md)
            return OK
        try:
            name = str(local_hostname)
            host, sep, port_s = name.rpartition(":")
            chosen = not sep or not port_s.isdigit()
            if chosen:
                host = name
            bind_host = "127.0.0.1" if host in ("", "localhost") else host
            if metadata_server in ("", "P2PHANDSHAKE"):
                metadata_server = _p2p_metadata(master_server_addr)
            ssd_path = (ssd_offload_path or os.environ.get("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH")
                        ) if enable_ssd_offload else None
            from pymooncake.transfer import TransferConfig

            # A port we chose can be taken by another process between the check and the
            # bind: choose again, as Mooncake's real_client retries its port
            for attempt in range(PORT_ATTEMPTS if chosen else 1):
                port = free_port() if chosen else int(port_s)
                client = StoreClient(master_server_addr, metadata_server,
                                     local_hostname=bind_host, global_segment_size=gseg,
                                     local_buffer_size=lbuf, ssd_path=ssd_path or None,
                                     ssd_capacity=gseg * 4 if ssd_path else 0,
                                     transfer_config=TransferConfig(tcp_port=port),
                                     name=f"{host or bind_host}:{port}" if port else None)
                try:
                    client.start()
                    break
                except StoreError as e:
                    if attempt + 1 >= (PORT_ATTEMPTS if chosen else 1) or not _port_taken(e):
                        raise
        except Exception as e:  # noqa: BLE001
            return code(e) if isinstance(e, StoreError | ValueError) else int(
                ErrorCode.INTERNAL_ERROR)
        self._client = client
        self._hostname = client.segment_name if port else f"{host or bind_host}:{port}"
        self._local_buffer_size = lbuf
        self._setup_args = (master_server_addr, metadata_server)
        return OK

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int, server_address: str
                    ) -> int:
        """Mooncake's dummy client: a process without its own segment that works through
        the real client serving at ``server_address`` (``python -m pymooncake.compat
        real-client``). pymooncake asks the real client for its master, metadata service and
        segment, then connects as a client of ``local_buffer_size`` whose puts prefer the
        real client's segment (``mem_pool_size`` is that share of its memory)."""
        from pymooncake.store.compat._dummy import ask_real_client

        try:
            info = ask_real_client(server_address)
        except Exception as e:  # noqa: BLE001 - reported as Mooncake's RPC_FAIL
            import logging

            logging.getLogger(__name__).error("setup_dummy: real client %s: %s",
                                              server_address, e)
            return int(ErrorCode.RPC_FAIL)
        rc = self.setup("localhost", info["metadata"], 0, local_buffer_size, "tcp", "",
                        info["master"])
        if rc == OK:
            self._prefer_segment = info["segment"]
            self._mem_pool_left = int(mem_pool_size)
        return rc

    def alloc_from_mem_pool(self, size: int) -> int:
        """Address of ``size`` bytes of registered memory for ``put_from``/``get_into``
        (Mooncake: from the shared memory pool of ``setup_dummy``'s ``mem_pool_size``); 0
        when the pool is used up or the store is not set up. Kept until ``close``."""
        if self._client is None or size <= 0 or size > self._mem_pool_left:
            return 0
        import numpy as np

        raw = np.zeros(size + 4096, dtype=np.uint8)
        ptr = int(raw.ctypes.data) + (-int(raw.ctypes.data) % 4096)
        if self.register_buffer(ptr, size) != OK:
            return 0
        self._mem_pool.append((ptr, size, raw))
        self._mem_pool_left -= size
        return ptr

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
        self._stop_tasks()
        if self._client is not None:
            self._end_sessions()
            self._client.close()
            self._client = None
        self._mem_pool.clear()
        return OK

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

    def _in_pool(self, ptr: int, size: int) -> bool:
        return any(p <= ptr and ptr + size <= p + n for p, n, _ in self._mem_pool)

    def _registered(self, ptr: int, size: int) -> bool:
        """Whether ``[ptr, ptr+size)`` lies in memory registered with this client."""
        c = self._client
        return c is not None and bool(c._in_registered(int(ptr), int(size)))
