"""The Conductor's store-tier view follows the Store master's leadership (BUG-58 step 6).

The Conductor knows which block keys the global Store holds from KV events (holder
``"store"``). With HA masters (docs/store.md) a new leader may hold fewer objects than the
old one (unfinished puts, records it refused), so on every change of leader the
Conductor drops its whole store-tier view and rebuilds it from the events that follow;
it never keeps entries the new leader may not have. ``store_master`` is the Store's HA
address ``etcd://host:port[/cluster_id]`` (cluster ``default`` when omitted); the leader
key is ``pymooncake/store/<cluster_id>/leader``, watched through the metadata interface.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from urllib.parse import urlsplit

from pymooncake.metadata import MetadataError, open_metadata
from pymooncake.metadata.base import EventKind
from pymooncake.obs.logging import init_logger

logger = init_logger(__name__)


def parse_store_master(store_master: str) -> tuple[str, str]:
    """``etcd://h:p[/cluster]`` → (metadata URL, leader key); ``ValueError`` otherwise."""
    parts = urlsplit(store_master) if isinstance(store_master, str) else None
    if parts is None or parts.scheme not in ("etcd", "embedded") or not parts.netloc:
        raise ValueError(f"store_master={store_master!r}: expected "
                         "etcd://host:port[/cluster_id] (the Store's HA masters)")
    cluster = parts.path.strip("/") or "default"
    if "/" in cluster:
        raise ValueError(f"store_master={store_master!r}: the cluster id has no '/'")
    return f"{parts.scheme}://{parts.netloc}", f"pymooncake/store/{cluster}/leader"


async def follow_store_leader(store_master: str, on_change: Callable[[], None],
                              retry_s: float = 1.0) -> None:
    """Call ``on_change()`` each time the Store's leader key names a new leader (not for
    the first one seen). Runs until cancelled; an unreachable etcd is retried every
    ``retry_s`` seconds (a change missed meanwhile is noticed on the next read)."""
    url, key = parse_store_master(store_master)
    md = open_metadata(url)
    seen: bytes | None = None
    try:
        while True:
            watch = None
            try:
                watch = await md.watch_prefix(key)
                kv = await md.get(key)
                seen = _changed(seen, kv.value if kv is not None else None, on_change)
                async for ev in watch:
                    if ev.key == key and ev.kind is EventKind.PUT:
                        seen = _changed(seen, ev.value, on_change)
            except (MetadataError, OSError) as e:
                logger.info("store leader watch on %s interrupted (%s); retrying", url, e)
            finally:
                if watch is not None:
                    with contextlib.suppress(Exception):
                        await watch.close()
            await asyncio.sleep(retry_s)
    finally:
        with contextlib.suppress(Exception):
            await md.close()


def _changed(seen: bytes | None, value: bytes | None,
             on_change: Callable[[], None]) -> bytes | None:
    if value is None:
        return seen  # no leader right now: wait for the next one
    if seen is not None and value != seen:
        on_change()
    return value
