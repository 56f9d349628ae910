"""Hosts as network namespaces on a bridge, with a real etcd, for the fault tests
(issue 17 Build item 5). Same construction as ``tests/serving/test_multihost.py``: each
host is a namespace with its own address (``NET.1<i>``) and hostname; the test process
itself sits on the bridge (``NET.1``) and reaches every host directly.

``Hosts.close()`` kills every role it started (SIGCONT first: a frozen one must die too)
and deletes every namespace, veth and the bridge, whatever state the test left them in.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from functools import cache
from pathlib import Path

import pytest


@cache
def missing() -> str | None:
    """Why namespaced hosts cannot be had here (checked once), else ``None``."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "unshare", "tc"):
        if shutil.which(tool) is None:
            return f"no {tool} binary"
    if etcd_binary() is None:
        return "no etcd binary"
    probe = f"pfprobe{os.getpid() % 100000}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.decode().strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@cache
def netem_missing() -> str | None:
    """Why ``tc netem`` cannot be had here (checked once), else ``None``."""
    probe = f"pfnetem{os.getpid() % 100000}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True)
    if r.returncode != 0:
        return "cannot create a network namespace"
    try:
        r = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "replace", "dev",
                            "lo", "root", "netem", "loss", "1%"], capture_output=True)
        return None if r.returncode == 0 else \
            f"no tc netem in this kernel: {r.stderr.decode().strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def etcd_binary() -> str | None:
    return shutil.which("etcd") or next(
        (p for p in ("/usr/bin/etcd", "/usr/local/bin/etcd") if Path(p).exists()), None)


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


class Role:
    """One ``pymooncake`` process on a host; ``info`` is its ``ready`` line."""

    def __init__(self, popen: subprocess.Popen, info: dict) -> None:
        self.popen, self.info = popen, info

    @property
    def pid(self) -> int:  # ip netns exec / unshare / sh all exec: this is Python's pid
        return self.popen.pid

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)


class Hosts:
    """``n`` namespaced hosts ``1..n`` on one bridge, etcd at ``etcd://NET.1:<port>``."""

    _seq = 0

    def __init__(self, n: int) -> None:
        Hosts._seq += 1
        pid = os.getpid() % 10000
        self.tag = f"pf{pid}{Hosts._seq}"[:8]
        self.net = f"10.{232 + Hosts._seq % 20}.{pid % 250}"
        self.n = n
        self.bridge = f"{self.tag}br"
        self.made_ns: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self._dir = tempfile.mkdtemp(prefix="pmfault-")
        self._up = False

    def ns(self, i: int) -> str:
        return f"{self.tag}h{i}"

    def veth(self, i: int) -> str:
        return f"{self.tag}v{i}"

    def ip(self, i: int) -> str:
        return f"{self.net}.1{i}"

    @property
    def topology(self) -> str:
        """A Transfer Engine topology file for a process in the root namespace: its paths
        leave through the bridge (discovery would bind them to the machine's NIC, whose
        address the hosts cannot answer)."""
        path = Path(self._dir) / "topology.json"
        path.write_text(json.dumps({"cpu:0": [[self.bridge], []]}))
        return str(path)

    @property
    def etcd(self) -> str:
        return f"etcd://{self.net}.1:2379"

    def start(self) -> Hosts:
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        self._up = True
        _sh("ip", "addr", "add", f"{self.net}.1/24", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        for i in range(1, self.n + 1):
            ns, veth = self.ns(i), self.veth(i)
            _sh("ip", "netns", "add", ns)
            self.made_ns.append(ns)
            _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", veth + "p")
            _sh("ip", "link", "set", veth + "p", "master", self.bridge)
            _sh("ip", "link", "set", veth + "p", "up")
            _sh("ip", "link", "set", veth, "netns", ns)
            _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.ip(i)}/24", "dev", veth)
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", veth, "up")
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        cu, pu = f"http://{self.net}.1:2379", f"http://{self.net}.1:2380"
        self.procs.append(subprocess.Popen(
            [str(etcd_binary()), "--name", self.tag, "--data-dir", f"{self._dir}/etcd",
             "--listen-client-urls", cu, "--advertise-client-urls", cu,
             "--listen-peer-urls", pu, "--initial-advertise-peer-urls", pu,
             "--initial-cluster", f"{self.tag}={pu}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return self

    def role(self, host: int, *argv: str, timeout_s: float = 60.0) -> Role:
        """Start ``pymooncake <argv>`` on ``host`` and wait for its ``ready`` line."""
        inner = " ".join([sys.executable, "-m", "pymooncake", *argv])
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        p = subprocess.Popen(
            ["ip", "netns", "exec", self.ns(host), "unshare", "-u", "sh", "-c",
             f"hostname {self.tag}-host{host} && exec {inner}"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        self.procs.append(p)
        return Role(p, _ready(p, f"{argv[0]} on host {host}", timeout_s))

    def cut(self, host: int) -> None:
        """Partition ``host`` from every other (its bridge port goes down: frames to and
        from it are dropped silently, as with ``netem loss 100%``, which this kernel may
        lack, see ``netem_missing``)."""
        _sh("ip", "link", "set", self.veth(host) + "p", "down")

    def heal(self, host: int) -> None:
        subprocess.run(["ip", "link", "set", self.veth(host) + "p", "up"], capture_output=True)

    def netem(self, host: int, spec: str) -> None:
        """``tc netem`` on ``host``'s interface (e.g. ``loss 100%``); ``""`` removes it."""
        dev = self.veth(host)
        if spec:
            _sh("ip", "netns", "exec", self.ns(host), "tc", "qdisc", "replace", "dev", dev,
                "root", "netem", *spec.split())
        else:
            subprocess.run(["ip", "netns", "exec", self.ns(host), "tc", "qdisc", "del", "dev",
                            dev, "root"], capture_output=True)

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
                p.terminate()
        deadline = time.monotonic() + 4.0       # one grace period for all, then SIGKILL
        for p in reversed(self.procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        for ns in self.made_ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if self._up:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        shutil.rmtree(self._dir, ignore_errors=True)


def _ready(proc: subprocess.Popen, what: str, timeout_s: float) -> dict:
    """The first ``{"event": "ready", ...}`` line a pymooncake role prints."""
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    buf = b""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with status {proc.returncode}")
        buf += proc.stdout.read() or b""
        for line in buf.splitlines():
            if line.startswith(b"{"):
                info = json.loads(line)
                if info.get("event") == "ready":
                    return info
        time.sleep(0.1)
    pytest.fail(f"{what} not ready in {timeout_s:.0f} s")
