"""Same-host RPC over a Unix socket: a server bound to a loopback or wildcard address also
listens on the abstract Unix socket named after its address family and TCP port, and a
client whose target is a loopback address connects there first (falling back to TCP when
nothing listens there or the connect fails).

Why: on one host a Unix stream socket carries the same frames for about half the kernel
CPU of TCP loopback, which runs the whole TCP/IP path on both ends (docs/benchmarks.md,
"Issue 16, session 34": a blocking 40-byte round trip took 28 µs of CPU on both ends
against 54). Redis and PostgreSQL offer local clients a Unix socket for the same reason.
The frames and the per-call timeouts are those of the TCP path (``rpc.codec``,
``rpc.client``); a connect that fails or times out (``timeout_s`` / ``connect_timeout_s``
seconds) falls back to TCP, so a call may spend that timeout twice before it gives up.

The names are abstract (Linux: no file, gone with the listening socket):
``"\\0pymooncake-rpc-v4-<port>"`` for a server reachable at ``127.0.0.1:<port>`` and
``"\\0pymooncake-rpc-v6-<port>"`` at ``[::1]:<port>`` — the family is in the name because
a TCP port can be held once per family (``::`` and ``0.0.0.0``, ``::1`` and
``127.0.0.1``). Abstract names are scoped by network namespace, as TCP ports are, so
several "hosts" made with namespaces do not see each other's. A server whose name is
already bound fails to start (``OSError``), as it would on a TCP port already in use:
only a foreign process can hold it.

``PYMOONCAKE_RPC_UNIX=0`` in the environment (exactly ``0``) turns it off on both ends; it
is read at each server start and client connect.
"""

from __future__ import annotations

import os
import sys

ENV = "PYMOONCAKE_RPC_UNIX"

_V4, _V6 = "v4", "v6"
_CLIENT = {"127.0.0.1": (_V4,), "::1": (_V6,), "localhost": (_V4, _V6)}
_SERVER = {"127.0.0.1": (_V4,), "0.0.0.0": (_V4,), "::1": (_V6,), "::": (_V6,),
           "localhost": (_V4, _V6), "": (_V4, _V6)}


class UnixNameTaken(OSError):
    """``RpcServer.start``: the server's same-host Unix name is bound already (``errno``
    ``EADDRINUSE``; the message names the socket). A subclass so that a caller reporting
    bind errors keeps these words instead of the generic "address already in use"."""


def enabled() -> bool:
    """Linux (abstract names) and not turned off by ``PYMOONCAKE_RPC_UNIX=0``."""
    return sys.platform.startswith("linux") and os.environ.get(ENV, "1") != "0"


def unix_name(port: int, family: str = _V4) -> str:
    """The abstract Unix socket name of the RPC server on TCP ``port`` reachable over
    loopback of ``family`` (``"v4"``: 127.0.0.1, ``"v6"``: ::1)."""
    if family not in (_V4, _V6):
        raise ValueError(f"family must be 'v4' or 'v6', got {family!r}")
    return f"\0pymooncake-rpc-{family}-{int(port)}"


def client_names(host: str, port: int) -> list[str]:
    """Where a client of ``host:port`` tries first, in order: the Unix names for a loopback
    ``host`` (``127.0.0.1``, ``::1``, ``localhost``: both, v4 first), ``[]`` for any other
    host or when turned off (TCP only)."""
    if not enabled():
        return []
    return [unix_name(port, f) for f in _CLIENT.get(host, ())]


def server_names(host: str | None, port: int) -> list[str]:
    """The Unix names a server bound to ``host`` (``None`` or ``""``: every address) on
    TCP ``port`` also listens on: those of the loopback families it serves; ``[]`` for a
    server on one non-loopback address or when turned off."""
    if not enabled():
        return []
    return [unix_name(port, f) for f in _SERVER.get("" if host is None else host, ())]
