"""Helpers of the Mooncake-compatible ``TransferEngine`` facade (``transfer.compat``):
metadata connection strings, the local topology as Mooncake prints it, peer probes and
Mooncake's ``TransferNotify``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket

from pymooncake.metadata import open_metadata
from pymooncake.transfer.segment import SegmentDescriptor, segment_key
from pymooncake.transfer.topology import get_topology

PROBE_TIMEOUT_S = 3.0


class TransferNotify:
    """Mooncake's notification record (``name``, ``msg``)."""

    __slots__ = ("name", "msg")

    def __init__(self, name: str = "", msg: str = "") -> None:
        self.name, self.msg = name, msg

    def __repr__(self) -> str:
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"


def conn_string(metadata_server: str, metadata_type: str) -> str:
    """``initialize_ext``'s metadata address: a full URL or ``P2PHANDSHAKE`` as given,
    else ``<metadata_type>://<metadata_server>`` (``/metadata`` added for http)."""
    if "://" in metadata_server or metadata_server.upper() in ("P2PHANDSHAKE", "P2P"):
        return metadata_server
    kind = (metadata_type or "etcd").lower()
    if kind == "p2p":
        return "P2PHANDSHAKE"
    url = f"{kind}://{metadata_server}"
    return url + "/metadata" if kind == "http" and "/" not in metadata_server else url


def local_topology_json(device_name: str | None = None) -> str:
    """``{"cpu:N": [[preferred devices], [secondary devices]], ...}`` (Mooncake's form),
    optionally restricted to ``device_name`` (comma-separated names)."""
    topo = get_topology()
    keep = {d.strip() for d in (device_name or "").split(",") if d.strip()}
    out = {}
    for loc, (pref, sec) in topo.matrix.items():
        p = [d for d in pref if not keep or d in keep]
        s = [d for d in sec if not keep or d in keep]
        out[loc] = [p, s]
    return json.dumps(out)


def _run(coro_fn):  # type: ignore[no-untyped-def]
    """Runs ``coro_fn()`` on a fresh event loop in a helper thread (callers may be inside
    a running loop)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro_fn()).result(PROBE_TIMEOUT_S * 2)


def lookup(metadata_url: str, segment: str) -> SegmentDescriptor | None:
    """A segment's published descriptor, or None."""
    async def get() -> SegmentDescriptor | None:
        md = open_metadata(metadata_url)
        try:
            kv = await asyncio.wait_for(md.get(segment_key(segment)), PROBE_TIMEOUT_S)
        finally:
            close = getattr(md, "close", None)
            if close is not None:
                res = close()
                if asyncio.iscoroutine(res):
                    await res
        return None if kv is None else SegmentDescriptor.decode(kv.value)

    return _run(get)


def probe(metadata_url: str, segment: str) -> int:
    """0 when ``segment`` is published and its data port accepts a connection, else -1."""
    try:
        desc = lookup(metadata_url, segment)
    except Exception:  # noqa: BLE001 - an unreachable metadata service is a failed probe
        return -1
    if desc is None or not desc.tcp_port:
        return -1
    try:
        with socket.create_connection((desc.host, desc.tcp_port), PROBE_TIMEOUT_S):
            return 0
    except OSError:
        return -1
