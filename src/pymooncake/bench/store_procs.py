"""The processes behind ``pymooncake bench store``: start and stop a pymooncake cluster
(master with its HTTP metadata server, optionally a storage process) or Mooncake's
``mooncake_master``, and count the CPU time of the bench process and its helpers.

Holds ``_pymooncake_cluster``, ``_mooncake_cluster``, ``mooncake_available``,
``_mooncake_master``, ``_spawn`` / ``_stop`` / ``_free_port``, ``_HELPERS`` (pids whose CPU
time counts) and ``_helpers_cpu_s``; ``bench.store`` re-exports them for its callers.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

from pymooncake.bench.transfer_refs import tasks_cpu_s

MiB = 1 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(argv: list[str], ready: Callable[[bytes], dict | None], timeout_s: float = 30.0
           ) -> tuple[subprocess.Popen, dict]:
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and p.poll() is None:
            if sel.select(0.1):
                info = ready(p.stdout.readline())  # type: ignore[union-attr]
                if info is not None:
                    return p, info
        raise RuntimeError(f"{argv[0]} did not start")
    except BaseException:
        p.kill()
        raise
    finally:
        sel.close()


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def _ready_json(line: bytes) -> dict | None:
    if line.startswith(b"{"):
        info = json.loads(line)
        if info.get("event") == "ready":
            return info
    return None


MASTER_FLAGS: list[str] = []
"""More flags for every pymooncake master a bench cluster starts (``bench store
--rpc-poll S`` sets ``["--rpc-poll", S]``)."""


@contextlib.contextmanager
def _pymooncake_cluster(segment_bytes: int
                        ) -> Iterator[tuple[str, str, subprocess.Popen | None]]:
    exe = [sys.executable, "-m", "pymooncake"]
    master, info = _spawn([*exe, "master", "--port", "0", "--enable-http-metadata-server",
                           "--http-metadata-server-port", str(_free_port()),
                           "--eviction-high-watermark-ratio", "1.0", *MASTER_FLAGS],
                          _ready_json)
    addr, md = f"127.0.0.1:{info['port']}", info["metadata_url"]
    server = None
    try:
        _HELPERS[:] = [master.pid]
        if segment_bytes:  # 0: no storage process (the client's own segment holds all)
            server, _ = _spawn([*exe, "store-server", "--master", addr, "--metadata", md,
                                "--global-segment-size", str(segment_bytes),
                                "--transports", "local,tcp"], _ready_json)
            _HELPERS.append(server.pid)
        yield addr, md, server
    finally:
        _HELPERS.clear()
        if server is not None:
            _stop(server)
        _stop(master)


_HELPERS: list[int] = []
"""Pids of the running cluster's other processes (master, storage process): their CPU time
is counted with the bench process's in ``cpu_s_per_op``."""


def _helpers_cpu_s(pids: list[int]) -> float:
    """CPU seconds so far of ``pids``, all their threads (``transfer_refs.tasks_cpu_s``)."""
    return sum(tasks_cpu_s(p) for p in pids)


_MC_HOLDER = """
import sys, time
sys.path.append(sys.argv[4])
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
rc = s.setup("localhost", sys.argv[1], int(sys.argv[3]), 16 << 20, "tcp", "", sys.argv[2])
print("ready" if rc == 0 else f"failed {rc}", flush=True)
time.sleep(3600)
"""


def mooncake_available() -> bool:
    try:
        import mooncake.store  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "absent"
        return False
    return _mooncake_master() is not None


def _mooncake_master() -> str | None:
    exe = shutil.which("mooncake_master") or os.path.join(os.path.dirname(sys.executable),
                                                          "mooncake_master")
    return exe if os.path.exists(exe) else None


@contextlib.contextmanager
def _mooncake_cluster() -> Iterator[tuple[str, str]]:
    mport, hport = _free_port(), _free_port()
    exe = _mooncake_master()
    assert exe is not None
    master = subprocess.Popen([exe, f"--rpc_port={mport}", "--enable_http_metadata_server=true",
                               "--http_metadata_server_host=127.0.0.1",
                               f"--http_metadata_server_port={hport}",
                               f"--metrics_port={_free_port()}",
                               "--eviction_high_watermark_ratio=1.0"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", mport), 1):
                break
            time.sleep(0.1)
        time.sleep(0.3)
        _HELPERS[:] = [master.pid]
        yield f"127.0.0.1:{mport}", f"http://127.0.0.1:{hport}/metadata"
    finally:
        _HELPERS.clear()
        _stop(master)

