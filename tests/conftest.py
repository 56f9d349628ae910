"""Fixtures every test directory may use: a real etcd on free loopback ports."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def etcd_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("etcd") or next(
        (p for p in ("/usr/bin/etcd", "/usr/local/bin/etcd") if Path(p).exists()), None)
    if binary is None:
        pytest.skip("no etcd binary found (apt-get install etcd-server, or `make system-deps`)")
    client_port, peer_port = free_port(), free_port()
    data_dir = tmp_path_factory.mktemp("etcd")
    cu, pu = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    proc = subprocess.Popen(
        [binary, "--name", "t", "--data-dir", str(data_dir),
         "--listen-client-urls", cu, "--advertise-client-urls", cu,
         "--listen-peer-urls", pu, "--initial-advertise-peer-urls", pu,
         "--initial-cluster", f"t={pu}",
         # Fast elections keep etcd's minimum lease TTL at 1 s for the TTL tests.
         "--heartbeat-interval", "10", "--election-timeout", "100"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while True:
            if proc.poll() is not None:
                pytest.fail(f"etcd exited with status {proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", client_port), timeout=0.2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("etcd did not listen within 15 s")
                time.sleep(0.05)
        yield f"etcd://127.0.0.1:{client_port}"
    finally:
        proc.kill()
        proc.wait(timeout=10)
