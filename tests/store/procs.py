"""Start real master and store-server processes on 127.0.0.1 for the store tests."""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    popen: subprocess.Popen
    info: dict = field(default_factory=dict)

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(5)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()


def spawn(args: list[str], timeout_s: float = 20.0) -> Proc:
    """Run ``pymooncake ARGS``; wait for its ``ready`` JSON line (raises on timeout)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.Popen([sys.executable, "-m", "pymooncake", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env, cwd=ROOT)
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if p.poll() is not None:
                raise RuntimeError(f"{args[0]} exited {p.returncode}: "
                                   f"{p.stderr.read().decode()[-2000:]}")
            if sel.select(0.1):
                line = p.stdout.readline()
                if line.startswith(b"{"):
                    info = json.loads(line)
                    if info.get("event") == "ready":
                        return Proc(p, info)
        raise TimeoutError(f"{args[0]} not ready in {timeout_s}s")
    except BaseException:
        p.kill()
        p.wait(5)
        raise
    finally:
        sel.close()


class Cluster:
    """One master (with its HTTP metadata server) and any number of store servers."""

    def __init__(self, *master_flags: str, separate_metadata: bool = False) -> None:
        self.procs: list[Proc] = []
        self.md_server = None
        self.master_flags = list(master_flags)
        if separate_metadata:  # outlives master restarts
            from pymooncake.metadata.http import MetadataHttpServer

            self.md_server = MetadataHttpServer("127.0.0.1", 0).start()
            self.master_port = free_port()
            self.master = spawn(["master", "--port", str(self.master_port), *master_flags])
            self.metadata_url = self.md_server.url
        else:
            self.master = spawn(["master", "--port", "0", "--enable-http-metadata-server",
                                 "--http-metadata-server-port", "0",  # the kernel picks: no race
                                 *master_flags])
            self.master_port = self.master.info["port"]
            self.metadata_url = self.master.info["metadata_url"]
        self.procs.append(self.master)
        self.master_addr = f"127.0.0.1:{self.master_port}"

    def restart_master(self) -> None:
        """Kill the master (no snapshot) and start a fresh one at the same address."""
        self.master.kill()
        self.master = spawn(["master", "--port", str(self.master_port), *self.master_flags])
        self.procs.append(self.master)

    def store_server(self, size: int = 16 * MiB, *flags: str,
                     transports: str = "local,shm,tcp") -> Proc:
        p = spawn(["store-server", "--master", self.master_addr, "--metadata",
                   self.metadata_url, "--global-segment-size", str(size),
                   "--transports", transports, "--heartbeat-interval", "0.2", *flags])
        self.procs.append(p)
        return p

    def client(self, **kw):
        from pymooncake.store.client import StoreClient
        from pymooncake.transfer import TransferConfig

        kw.setdefault("transfer_config", TransferConfig(
            transports=("local", "shm", "tcp"), max_retries=1, path_retry_interval_s=0.05,
            connect_timeout_s=1.0, slice_timeout_s=2.0))
        kw.setdefault("heartbeat_interval_s", 0.2)
        c = StoreClient(self.master_addr, self.metadata_url, **kw).start()
        return c

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        if self.md_server is not None:
            self.md_server.stop()


def wait_for_port(port: int, timeout_s: float = 15.0, settle_s: float = 0.3) -> None:
    """Wait until 127.0.0.1:``port`` accepts a connection (then ``settle_s`` more, for a
    server that listens before it has finished starting), at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 1).close()
            break
        except OSError:
            time.sleep(0.1)
    time.sleep(settle_s)


def mooncake_python() -> str:
    """The Python with Mooncake's wheel (``PYMOONCAKE_MOONCAKE_PYTHON``) for the opt-in
    side-by-side tests; skips the calling test unless ``PYMOONCAKE_COMPAT_VS_MOONCAKE=1``."""
    import pytest

    py = os.environ.get("PYMOONCAKE_MOONCAKE_PYTHON")
    if os.environ.get("PYMOONCAKE_COMPAT_VS_MOONCAKE") != "1" or not py:
        pytest.skip("set PYMOONCAKE_COMPAT_VS_MOONCAKE=1 and PYMOONCAKE_MOONCAKE_PYTHON")
    return py


def run_against_mooncake_master(py: str, cmd: list[str], after: list[str] | None = None,
                                input: str | None = None,
                                master_flags: tuple[str, ...] = ()) -> str:
    """Start the wheel's ``mooncake_master`` (beside ``py``, with its HTTP metadata server)
    on free ports, run ``[py, *cmd, MASTER_ADDR, METADATA_URL, *after]`` against it and
    return its stdout; the master is killed afterwards. Fails the test on a non-zero exit."""
    mport, hport = free_port(), free_port()
    master = subprocess.Popen(
        [str(Path(py).parent / "mooncake_master"), f"--rpc_port={mport}",
         "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
         f"--http_metadata_server_port={hport}", f"--metrics_port={free_port()}",
         *master_flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(mport)
        res = subprocess.run([py, *cmd, f"127.0.0.1:{mport}",
                              f"http://127.0.0.1:{hport}/metadata", *(after or [])],
                             input=input, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
        return res.stdout
    finally:
        master.kill()
        master.wait(5)
