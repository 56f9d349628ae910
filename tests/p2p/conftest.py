"""Shared helpers of the P2P process tests: ``pymooncake p2p`` children, their ready line
and their end."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture()
def procs() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


def start_p2p(procs: list, etcd: str, *argv: str) -> subprocess.Popen:
    """``pymooncake p2p ARGV --metadata ETCD`` as a child (pipes, unbuffered)."""
    p = subprocess.Popen([sys.executable, "-m", "pymooncake", "p2p", *argv, "--metadata", etcd],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    procs.append(p)
    return p


def wait_ready(p: subprocess.Popen, timeout_s: float = 30.0) -> dict:
    """The child's ``{"event": "ready", ...}`` line; fails the test if it exits first."""
    assert p.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if select.select([p.stdout], [], [], 0.1)[0]:
            line = p.stdout.readline()
            if line.startswith('{"event": "ready"'):
                return json.loads(line)
        if p.poll() is not None:
            pytest.fail(f"exited {p.returncode}: {p.stderr.read() if p.stderr else ''}")
    pytest.fail("no ready line")


def finish(p: subprocess.Popen, timeout_s: float = 60.0) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=timeout_s)
    return p.returncode, out, err


def assert_same_tree(a: Path, b: Path) -> None:
    """Every file under ``a`` is under ``b`` with the same bytes. A difference is reported
    by file, first differing offset and length (pytest's own diff of two large ``bytes``
    runs difflib over their reprs: minutes for a few hundred KiB)."""
    files = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    for f in files:
        x, y = (a / f).read_bytes(), (b / f).read_bytes()
        if x != y:
            pairs = list(zip(x, y, strict=False))
            at = next((i for i, (u, v) in enumerate(pairs) if u != v), len(pairs))
            diff = sum(u != v for u, v in pairs)
            blocks = sorted({i >> 16 for i, (u, v) in enumerate(pairs) if u != v})
            pytest.fail(f"{f}: {len(x)} vs {len(y)} bytes, {diff} differ, first at offset "
                        f"{at}, in 64 KiB blocks {blocks}")
