"""Same-host RPC over a Unix socket: a server bound to a loopback or wildcard address also
listens on the abstract Unix socket named after its TCP port, and a client whose target
is a loopback address connects there first (falling back to TCP when nothing listens).

Why: on one host a Unix stream socket carries the same frames for about half the kernel
CPU of TCP loopback, which does the whole TCP/IP path on both ends (docs/benchmarks.md,
issue 16, session 34: a blocking 40-byte round trip 28 µs of CPU against 54). Redis and
PostgreSQL offer local clients a Unix socket for the same reason. The frames, timeouts and
errors are those of TCP (``rpc.codec``); only the socket differs.

The name is abstract (Linux: no file, gone when the server closes) and carries only the
TCP port: ``"\\0pymooncake-rpc-<port>"``. Abstract names are scoped by network namespace,
as TCP ports are, so several "hosts" made with namespaces do not see each other's. Two
servers in one namespace on the same port but different loopback addresses (127.0.0.1
and ::1) would share a name: the first binds it, the second serves TCP only.

``PYMOONCAKE_RPC_UNIX=0`` in the environment turns it off on both ends (read at each
server start and client connect).
"""

from __future__ import annotations

import os
import sys

ENV = "PYMOONCAKE_RPC_UNIX"

_CLIENT_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
_SERVER_HOSTS = _CLIENT_HOSTS | {"0.0.0.0", "", "::"}


def enabled() -> bool:
    """Linux (abstract names) and not turned off by ``PYMOONCAKE_RPC_UNIX=0``."""
    return sys.platform.startswith("linux") and os.environ.get(ENV, "1") != "0"


def unix_name(port: int) -> str:
    """The abstract Unix socket name of the RPC server on TCP ``port``."""
    return f"\0pymooncake-rpc-{int(port)}"


def client_name(host: str, port: int) -> str | None:
    """Where a client of ``host:port`` tries first: the Unix name for a loopback ``host``
    (``enabled()``), else ``None`` (TCP only)."""
    return unix_name(port) if enabled() and host in _CLIENT_HOSTS else None


def serves_unix(host: str | None) -> bool:
    """Whether a server bound to ``host`` also listens on its Unix name: a loopback or
    wildcard address (clients on this host can reach it by ``127.0.0.1``)."""
    return enabled() and (host is None or host in _SERVER_HOSTS)
