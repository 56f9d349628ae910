"""Hosts as network namespaces on a bridge, with a real etcd, for the fault tests and the
soak benchmark (issue 17 Build items 5, 7). Same construction as
``tests/serving/test_multihost.py``: each host is a namespace with its own address
(``NET.1<i>``) and hostname; the calling process itself sits on the bridge (``NET.1``)
and reaches every host directly. Needs root, ``ip``, ``unshare``, ``tc`` and ``etcd``
(``missing()`` says which is lacking).

``Hosts.close()`` kills every role it started (SIGCONT first: a frozen one must die too)
and deletes every namespace, veth and the bridge, whatever state the test left them in.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from functools import cache
from pathlib import Path
from typing import Any


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
    """One ``pymooncake`` process on a host; ``info`` is its ``ready`` line, ``host`` and
    ``argv`` what started it (``Hosts.restart``)."""

    def __init__(self, popen: subprocess.Popen, info: dict, host: int = 0,
                 argv: tuple[str, ...] = ()) -> None:
        self.popen, self.info = popen, info
        self.host, self.argv = host, argv

    @property
    def pid(self) -> int:  # ip netns exec / unshare / sh all exec: this is Python's pid
        return self.popen.pid

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)


class Hosts:
    """``n`` namespaced hosts ``1..n`` on one bridge, etcd at ``etcd://NET.1:<port>``."""

    _seq = 0

    def __init__(self, n: int, log_dir: str | None = None) -> None:
        Hosts._seq += 1
        pid = os.getpid() % 10000
        self.tag = f"pf{pid}{Hosts._seq}"[:8]
        # several processes (pytest-xdist workers) may build hosts at once: their subnets
        # differ by the worker's number even when their pids collide modulo 50
        worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
        self.net = f"10.{232 + Hosts._seq % 20}.{(pid % 50) * 5 + worker % 5}"
        self.n = n
        self.bridge = f"{self.tag}br"
        self.made_ns: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self._dir = tempfile.mkdtemp(prefix="pmfault-")
        self._up = False
        self.log_dir = log_dir
        """When set, each role's stdout and stderr go to ``<log_dir>/<n>-h<host>-<role>.log``
        (kept after ``close``); else they are discarded."""
        self._roles_started = itertools.count(1)    # next() is atomic: roles may start
                                                    # from several threads at once

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
        log: Any = subprocess.DEVNULL
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            name = f"{next(self._roles_started):02d}-h{host}-{argv[0]}.log"
            log = open(Path(self.log_dir) / name, "ab", buffering=0)  # noqa: SIM115 - closed by _drain
        p = subprocess.Popen(
            ["ip", "netns", "exec", self.ns(host), "unshare", "-u", "sh", "-c",
             f"hostname {self.tag}-host{host} && exec {inner}"],
            stdout=subprocess.PIPE, stderr=log, env=env)
        self.procs.append(p)
        try:
            info = _ready(p, f"{argv[0]} on host {host}", timeout_s)
        except RuntimeError:
            if log is not subprocess.DEVNULL:
                log.close()
            raise
        assert p.stdout is not None     # drained from now on: a full pipe would block it
        os.set_blocking(p.stdout.fileno(), True)
        sink = None if log is subprocess.DEVNULL else log
        threading.Thread(target=_drain, args=(p.stdout, sink), daemon=True).start()
        return Role(p, info, host, argv)

    def restart(self, role: Role, timeout_s: float = 60.0) -> Role:
        """Start ``role``'s command again on its host (the old process should be dead)."""
        return self.role(role.host, *role.argv, timeout_s=timeout_s)

    def run(self, host: int, *cmd: str) -> str:
        """Run ``cmd`` in ``host``'s namespace (0: this one); its stdout."""
        pre = ["ip", "netns", "exec", self.ns(host)] if host else []
        return subprocess.run([*pre, *cmd], capture_output=True, text=True).stdout

    def cut(self, host: int) -> None:
        """Partition ``host`` from every other (its bridge port goes down: frames to and
        from it are dropped silently, as with ``netem loss 100%``, which this kernel may
        lack, see ``netem_missing``)."""
        _sh("ip", "link", "set", self.veth(host) + "p", "down")

    def heal(self, host: int) -> None:
        subprocess.run(["ip", "link", "set", self.veth(host) + "p", "up"], capture_output=True)

    def shape(self, host: int, mbit: float) -> None:
        """Rate-limit what ``host`` receives to ``mbit`` Mbit/s (``tc tbf`` on its bridge
        port; ``tbf`` is in kernels that lack ``netem``); ``0`` removes the limit."""
        dev = self.veth(host) + "p"
        if mbit:
            _sh("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit:g}mbit",
                "burst", "256kb", "latency", "100ms")
        else:
            subprocess.run(["tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)

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
    """The first ``{"event": "ready", ...}`` line a pymooncake role prints; ``RuntimeError``
    when it exits or is not ready in ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    buf = b""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}")
        buf += proc.stdout.read() or b""
        for line in buf.splitlines():
            if line.startswith(b"{"):
                info = json.loads(line)
                if info.get("event") == "ready":
                    return info
        time.sleep(0.1)
    raise RuntimeError(f"{what} not ready in {timeout_s:.0f} s")


def _drain(stream: Any, sink: Any = None) -> None:
    """Read ``stream`` to its end, copying it to ``sink`` (a binary file) when given."""
    with contextlib.suppress(OSError, ValueError):
        while chunk := stream.read(65536):
            if sink is not None:
                sink.write(chunk)
    if sink is not None:
        sink.close()
