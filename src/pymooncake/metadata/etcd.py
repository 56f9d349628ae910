"""etcd v3 metadata backend (``etcd://host:port``) through the asyncio client ``aetcd``.

Keys and values map one to one onto etcd keys (UTF-8) and values; leases are etcd leases
(TTL rounded up to whole seconds, as etcd grants them); watches are etcd prefix watches.
This is the backend Mooncake uses for HA masters (``etcd://h:p``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections.abc import Sequence

from pymooncake.metadata.base import (
    EventKind,
    KeyValue,
    LeaseId,
    LeaseNotFound,
    MetadataError,
    WatchEvent,
)
from pymooncake.metadata.core import check_txn, split_backend_url


def _prefix_end(prefix: bytes) -> bytes:
    """etcd's range end for "every key starting with ``prefix``"."""
    b = bytearray(prefix)
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"


class _EtcdWatch:
    """An etcd prefix watch. The next event is read by a task of its own, so a caller's
    ``wait_for(watch.__anext__(), t)`` that times out cancels only its wait, never the
    stream (cancelling aetcd's async generator closes it for good: every later read then
    ended at once, and HA candidates spun). A broken stream raises ``MetadataError``."""

    def __init__(self, watch, timeout_s: float) -> None:  # noqa: ANN001
        self._watch = watch
        self._it = watch.__aiter__()
        self._next: asyncio.Future | None = None
        self._timeout_s = timeout_s

    def __aiter__(self) -> _EtcdWatch:
        return self

    async def __anext__(self) -> WatchEvent:
        if self._next is None:
            self._next = asyncio.ensure_future(self._it.__anext__())
        try:  # a cancelled caller leaves the read pending: the next call gets its event
            ev = await asyncio.shield(self._next)
        except asyncio.CancelledError:
            raise
        except StopAsyncIteration:
            self._next = None
            raise
        except Exception as e:  # noqa: BLE001 - aetcd and gRPC raise several kinds
            self._next = None
            raise MetadataError(f"etcd watch failed: {e!r}") from e
        self._next = None
        kind = EventKind.PUT if ev.kind == "PUT" else EventKind.DELETE
        value = ev.kv.value if kind is EventKind.PUT else b""
        return WatchEvent(kind, ev.kv.key.decode(), value, int(ev.kv.mod_revision))

    async def close(self) -> None:
        if self._next is not None:
            self._next.cancel()  # (awaited without swallowing our own cancellation)
            await asyncio.wait([self._next], timeout=self._timeout_s)
            self._next = None
        with contextlib.suppress(Exception):  # bounded: a stuck stream must not hang us
            await asyncio.wait_for(self._watch.cancel(), self._timeout_s)


class EtcdMetadata:
    """Client of a real etcd v3 server (one ``aetcd.Client`` per event loop).

    ``url`` is ``etcd://host:port`` (the first of a comma-separated list is used).
    Raises :class:`MetadataError` when etcd cannot be reached.
    """

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        parts, port = split_backend_url(url, "etcd", "etcd://host:port",
                                        head=url.split(",")[0])
        self.url = url
        self.host = parts.hostname
        self.port = port or 2379
        self._timeout_s = timeout_s
        self._clients: dict[int, tuple[asyncio.AbstractEventLoop, object]] = {}
        self._lock = threading.Lock()
        self._closing: set[asyncio.Future] = set()

    async def _client(self):  # noqa: ANN202
        import aetcd

        loop = asyncio.get_running_loop()
        with self._lock:
            entry = self._clients.get(id(loop))
        if entry is not None and entry[0] is loop:
            return entry[1]
        client = aetcd.Client(host=self.host, port=self.port,
                              timeout=math.ceil(self._timeout_s))
        try:
            await asyncio.wait_for(client.connect(), timeout=self._timeout_s)
        except Exception as e:  # noqa: BLE001 - aetcd and wait_for raise several kinds
            raise MetadataError(f"etcd at {self.host}:{self.port} unreachable: {e!r}") from e
        with self._lock:
            self._clients[id(loop)] = (loop, client)
        return client

    async def _call(self, fn_name: str, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        import aetcd

        client = await self._client()
        try:
            return await getattr(client, fn_name)(*args, **kwargs)
        except aetcd.exceptions.ClientError as e:
            if "lease not found" in str(e) or "requested lease not found" in str(e):
                raise LeaseNotFound(f"lease is unknown or expired: {e}") from e
            raise MetadataError(f"etcd {fn_name} failed: {e}") from e

    async def get(self, key: str) -> KeyValue | None:
        r = await self._call("get", key.encode())
        if r is None:
            return None
        return KeyValue(key, r.value, int(r.mod_revision), LeaseId(r.lease) if r.lease else None)

    async def get_prefix(self, prefix: str) -> list[KeyValue]:
        rs = await self._call("get_prefix", prefix.encode())
        out = [KeyValue(r.key.decode(), r.value, int(r.mod_revision),
                        LeaseId(r.lease) if r.lease else None) for r in rs]
        return sorted(out, key=lambda kv: kv.key)

    async def put(self, key: str, value: bytes, *, lease_id: LeaseId | None = None) -> int:
        r = await self._call("put", key.encode(), bytes(value),
                             lease=int(lease_id) if lease_id is not None else None)
        return int(r.header.revision)

    async def create(self, key: str, value: bytes, *, lease_id: LeaseId | None = None) -> bool:
        client = await self._client()
        k = key.encode()
        try:
            ok, responses = await client.transaction(
                compare=[client.transactions.create(k) == 0],
                success=[client.transactions.put(
                    k, bytes(value), lease=int(lease_id) if lease_id is not None else None)],
                failure=[])
        except Exception as e:  # noqa: BLE001 - aetcd wraps gRPC errors in several types
            if "lease not found" in str(e):
                raise LeaseNotFound(f"lease {lease_id} is unknown or expired") from e
            raise MetadataError(f"etcd create failed: {e}") from e
        return bool(ok)

    async def guarded_write(self, guard_key: str, guard_revision: int,
                            puts: Sequence[tuple[str, bytes]] = (),
                            deletes: Sequence[str] = ()) -> int | None:
        check_txn(puts, deletes)
        client = await self._client()
        tx = client.transactions
        ops = [tx.put(k.encode(), bytes(v)) for k, v in puts]
        ops += [tx.delete(k.encode()) for k in deletes]
        try:
            ok, responses = await client.transaction(
                compare=[tx.mod(guard_key.encode()) == int(guard_revision)],
                success=ops, failure=[])
        except Exception as e:  # noqa: BLE001 - aetcd wraps gRPC errors in several types
            raise MetadataError(f"etcd guarded write failed: {e!r}") from e
        if not ok:
            return None
        for r in responses:  # every op answers with the header of the transaction
            inner = getattr(r, r.WhichOneof("response"), None)
            if inner is not None and inner.HasField("header"):
                return int(inner.header.revision)
        kv = await self._call("get", guard_key.encode())  # no operation: revision unchanged
        return int(kv.mod_revision) if kv is not None else int(guard_revision)

    async def delete(self, key: str) -> bool:
        r = await self._call("delete", key.encode())
        return bool(r and getattr(r, "deleted", 0))

    async def grant_lease(self, ttl_s: float) -> LeaseId:
        if not (ttl_s > 0 and math.isfinite(ttl_s)):
            raise ValueError(f"ttl_s must be a positive number of seconds, got {ttl_s}")
        lease = await self._call("lease", max(1, math.ceil(ttl_s)))
        return LeaseId(int(lease.id))

    async def keep_alive(self, lease_id: LeaseId) -> None:
        r = await self._call("refresh_lease", int(lease_id))
        if r is None or int(r.TTL) <= 0:
            raise LeaseNotFound(f"lease {lease_id} is unknown or expired; grant a new one")

    async def revoke_lease(self, lease_id: LeaseId) -> None:
        try:
            await self._call("revoke_lease", int(lease_id))
        except LeaseNotFound:
            return

    async def watch_prefix(self, prefix: str) -> _EtcdWatch:
        client = await self._client()
        try:  # bounded: aetcd waits for its watch stream without a limit in places
            watch = await asyncio.wait_for(
                client.watch(prefix.encode(), range_end=_prefix_end(prefix.encode())),
                self._timeout_s)
        except Exception as e:  # noqa: BLE001 - aetcd, gRPC and wait_for raise several kinds
            self._forget(client)
            raise MetadataError(f"etcd watch of {prefix!r} failed: {e!r}") from e
        return _EtcdWatch(watch, self._timeout_s)

    def _forget(self, client) -> None:  # noqa: ANN001
        """Drop ``client`` (its watch stream is stuck or broken): the next call of this
        loop connects afresh. The old channel is closed in the background, bounded."""
        loop = asyncio.get_running_loop()
        with self._lock:
            entry = self._clients.get(id(loop))
            if entry is None or entry[1] is not client:
                return
            del self._clients[id(loop)]

        async def close() -> None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), self._timeout_s)
        task = asyncio.ensure_future(close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            entry = self._clients.pop(id(loop), None)
        if entry is not None:
            await entry[1].close()
