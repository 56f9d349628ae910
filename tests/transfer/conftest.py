"""Fixtures: an HTTP metadata server and Transfer Engine peers in their own processes."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

PEER = Path(__file__).with_name("peer.py")


@pytest.fixture(scope="module")
def metadata_url() -> Iterator[str]:
    from pymooncake.metadata.http import MetadataHttpServer

    server = MetadataHttpServer("127.0.0.1", 0).start()
    try:
        yield server.url
    finally:
        server.stop()


@dataclass
class Peer:
    proc: subprocess.Popen[str]
    name: str
    addr: int
    length: int
    shm_addr: int
    port: int
    seed: int
    pid: int = 0

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        out = self.proc.stdout.readline().strip()
        assert out, f"peer {self.name} gave no answer to {line!r}"
        return out

    def digest(self, addr: int, length: int) -> str:
        return self.ask(f"digest {addr} {length}")

    def initial_bytes(self) -> np.ndarray:
        """The peer's registered buffer as it was filled (computed here, independently)."""
        return np.random.default_rng(self.seed).integers(0, 256, self.length, dtype=np.uint8)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def spawn_peer(metadata_url: str) -> Iterator[Callable[..., Peer]]:
    peers: list[Peer] = []

    def spawn(name: str, size: int = 8 << 20, seed: int = 1, **opts: object) -> Peer:
        cmd = [sys.executable, str(PEER), "--name", name, "--metadata", metadata_url,
               "--size", str(size), "--seed", str(seed)]
        for k, v in opts.items():
            cmd += [f"--{k.replace('_', '-')}", str(v)]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            proc.kill()
            raise RuntimeError(f"peer {name} failed to start (exit {proc.wait(timeout=10)})")
        info = json.loads(line)
        peer = Peer(proc, name, info["addr"], info["length"], info["shm_addr"], info["port"],
                    seed, info.get("pid", 0))
        peers.append(peer)
        return peer

    try:
        yield spawn
    finally:
        for p in peers:
            try:
                if p.proc.poll() is None and p.proc.stdin is not None:
                    p.proc.stdin.write("exit\n")
                    p.proc.stdin.flush()
                    p.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
            p.kill()
