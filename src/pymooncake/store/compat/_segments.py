"""Segment management and offload counters of ``MooncakeDistributedStore`` that have no
pymooncake counterpart, answering as Mooncake does when they cannot act (its
``DummyClient`` answers: ``-1``, ``{"ret": -1, ...}``), each logging why; and
``bind_to_numa_node`` (a module function in Mooncake's ``mooncake.store``).

Why no extra segments: a pymooncake client is one Transfer Engine serving one segment,
named after the engine (``host:port``) in the metadata service; peers resolve a replica's
segment name to that engine, the client's own-segment fast paths and SSD tier compare
against that one name, and the client re-mounts only that segment after a master restart
(case BUG-31). Mounting a second region (Mooncake's ``mount_segment`` of a file or
``allocate_and_mount_segment``) would need a second engine or per-segment descriptors in
the Transfer Engine, outside the compat layer. ``unmount_local_disk_segment`` drains
Mooncake's per-client local-disk segment, which pymooncake does not have (its SSD tier
belongs to the DRAM segment and goes with it at ``close``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

_NO_EXTRA_SEGMENTS = ("a pymooncake client serves exactly one segment (its Transfer "
                      "Engine's); extra segments are not supported (docs/compat.md)")


def _uint(v: Any, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise TypeError(f"{name}: expected an unsigned int, got {v!r}")
    return v


def _strs(v: Any, name: str) -> list[str]:
    if isinstance(v, str | bytes) or not isinstance(v, Sequence) or not all(
            isinstance(x, str) for x in v):
        raise TypeError(f"{name} must be a list of str")
    return list(v)


class SegmentMethods:
    """Mixed into ``MooncakeDistributedStore``."""

    def mount_segment(self, path: str, size: int, offset: int = 0, protocol: str = "tcp",
                      location: str = "") -> dict[str, Any]:
        """Mooncake: mount ``size`` bytes of ``path`` as extra segments. Not supported:
        ``{"ret": -1, "segment_ids": []}``."""
        if not isinstance(path, str) or not isinstance(protocol, str) or not isinstance(
                location, str):
            raise TypeError("path, protocol and location must be str")
        _uint(size, "size"), _uint(offset, "offset")
        logger.error("mount_segment(%r): %s", path, _NO_EXTRA_SEGMENTS)
        return {"ret": -1, "segment_ids": []}

    def allocate_and_mount_segment(self, size: int, protocol: str = "tcp",
                                   location: str = "") -> dict[str, Any]:
        """Mooncake: allocate ``size`` bytes and mount them. Not supported:
        ``{"ret": -1, "segment_ids": [], "allocated_size": 0}``."""
        _uint(size, "size")
        if not isinstance(protocol, str) or not isinstance(location, str):
            raise TypeError("protocol and location must be str")
        logger.error("allocate_and_mount_segment(%d): %s", size, _NO_EXTRA_SEGMENTS)
        return {"ret": -1, "segment_ids": [], "allocated_size": 0}

    def unmount_segment(self, segment_ids: Sequence[str], grace_period_seconds: int = 0
                        ) -> int:
        """Not supported (there is no extra segment to unmount): -1."""
        _strs(segment_ids, "segment_ids"), _uint(grace_period_seconds, "grace_period_seconds")
        logger.error("unmount_segment: %s", _NO_EXTRA_SEGMENTS)
        return -1

    def unmount_and_free_segment(self, segment_ids: Sequence[str],
                                 grace_period_seconds: int = 0) -> int:
        """Not supported: -1."""
        _strs(segment_ids, "segment_ids"), _uint(grace_period_seconds, "grace_period_seconds")
        logger.error("unmount_and_free_segment: %s", _NO_EXTRA_SEGMENTS)
        return -1

    def unmount_local_disk_segment(self, grace_period_seconds: int = 0) -> int:
        """Not supported (pymooncake has no per-client local-disk segment): -1."""
        _uint(grace_period_seconds, "grace_period_seconds")
        logger.error("unmount_local_disk_segment: pymooncake has no local-disk segment")
        return -1

    def get_offload_rpc_read_count(self) -> int:
        """Reads this client served from a peer's local-disk offload over RPC: always 0 in
        pymooncake, whose reads never go to a peer's disk (an SSD-only object is loaded
        into DRAM by its owner first, then read from DRAM)."""
        return 0


def bind_to_numa_node(node: int) -> None:
    """Run the calling thread on NUMA node ``node``'s CPUs (Linux
    ``/sys/devices/system/node``), as Mooncake's ``bind_to_numa_node``; a machine without
    NUMA information or an unknown node only logs a warning. Mooncake also sets libnuma's
    preferred allocation node; pymooncake does not (no libnuma binding), so memory
    follows the kernel's first-touch policy on the bound CPUs."""
    if isinstance(node, bool) or not isinstance(node, int):
        raise TypeError(f"node: expected an int, got {type(node).__name__}")
    base = "/sys/devices/system/node"
    if not os.path.isdir(base) or not hasattr(os, "sched_setaffinity"):
        logger.warning("NUMA is not available on this system; binding skipped")
        return
    try:
        with open(f"{base}/node{node}/cpulist") as f:
            spec = f.read().strip()
    except OSError:
        logger.warning("Invalid NUMA node: %d", node)
        return
    cpus: set[int] = set()
    for part in filter(None, spec.split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:
        logger.warning("binding to NUMA node %d failed: %s", node, e)
