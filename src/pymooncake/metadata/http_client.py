"""HTTP metadata backend, client side: ``HttpMetadata`` (httpx), the client of
``metadata.http.MetadataHttpServer`` and of Mooncake's HTTP metadata server (the wire
format is in ``metadata.http``'s docstring)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import httpx
import msgpack

from pymooncake.metadata.base import (
    EventKind,
    KeyValue,
    LeaseId,
    LeaseNotFound,
    MetadataError,
    WatchCompacted,
    WatchEvent,
)
from pymooncake.metadata.core import check_txn, split_backend_url
from pymooncake.metadata.http import WATCH_POLL_S


class _HttpWatch:
    def __init__(self, md: HttpMetadata, prefix: str, revision: int) -> None:
        self._md = md
        self._prefix = prefix
        self._revision = revision
        self._buffer: list[WatchEvent] = []
        self._closed = False

    def __aiter__(self) -> _HttpWatch:
        return self

    async def __anext__(self) -> WatchEvent:
        while not self._buffer:
            if self._closed:
                raise StopAsyncIteration
            payload = await self._md._watch_poll(self._prefix, self._revision,
                                                 WATCH_POLL_S)
            self._revision = payload["revision"]
            self._buffer.extend(payload["events"])
        return self._buffer.pop(0)

    async def close(self) -> None:
        self._closed = True


class HttpMetadata:
    """Client of :class:`MetadataHttpServer` (or any server speaking its protocol).

    ``url`` is ``http://host:port/metadata``. Raises :class:`MetadataError` when the server
    cannot be reached within ``timeout_s`` seconds.
    """

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        parts, port = split_backend_url(url, "http", "http://host:port/metadata")
        self.url = url
        self._base = f"http://{parts.hostname}:{port or 80}"
        self._path = parts.path or "/metadata"
        self._timeout_s = timeout_s
        self._clients: dict[int, tuple[asyncio.AbstractEventLoop, httpx.AsyncClient]] = {}
        self._lock = threading.Lock()

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        with self._lock:
            entry = self._clients.get(id(loop))
            if entry is None or entry[0] is not loop:
                # plain http only (__init__): no TLS, so no CA bundle to load (~20 ms of
                # CPU per client with httpx's default verify=True)
                entry = (loop, httpx.AsyncClient(base_url=self._base, timeout=self._timeout_s,
                                                 verify=False))
                self._clients[id(loop)] = entry
            return entry[1]

    async def _request(self, method: str, path: str, params: dict[str, object],
                       content: bytes | None = None,
                       timeout_s: float | None = None) -> httpx.Response:
        try:
            return await self._client().request(
                method, path, params=params, content=content,
                timeout=timeout_s if timeout_s is not None else self._timeout_s)
        except httpx.HTTPError as e:
            raise MetadataError(f"metadata server {self._base} unreachable: {e!r}") from e

    @staticmethod
    def _check(resp: httpx.Response, ok: tuple[int, ...] = (200,)) -> None:
        if resp.status_code == 404 and "lease" in resp.text:
            raise LeaseNotFound(resp.text)
        if resp.status_code == 410:
            raise WatchCompacted(resp.text)
        if resp.status_code not in ok:
            raise MetadataError(f"metadata server answered {resp.status_code}: {resp.text}")

    async def get(self, key: str) -> KeyValue | None:
        r = await self._request("GET", self._path, {"key": key})
        if r.status_code == 404:
            return None
        self._check(r)
        lid = int(r.headers.get("X-Lease-Id", "0"))
        return KeyValue(key, r.content, int(r.headers.get("X-Mod-Revision", "0")),
                        LeaseId(lid) if lid else None)

    async def get_prefix(self, prefix: str) -> list[KeyValue]:
        r = await self._request("GET", self._path + "/prefix", {"prefix": prefix})
        self._check(r)
        return [KeyValue(k, v, rev, LeaseId(lid) if lid else None)
                for k, v, rev, lid in msgpack.unpackb(r.content)]

    async def put(self, key: str, value: bytes, *, lease_id: LeaseId | None = None) -> int:
        params: dict[str, object] = {"key": key}
        if lease_id is not None:
            params["lease_id"] = int(lease_id)
        r = await self._request("PUT", self._path, params, bytes(value))
        self._check(r)
        return int(r.text or 0)

    async def create(self, key: str, value: bytes, *, lease_id: LeaseId | None = None) -> bool:
        params: dict[str, object] = {"key": key, "create": 1}
        if lease_id is not None:
            params["lease_id"] = int(lease_id)
        r = await self._request("PUT", self._path, params, bytes(value))
        if r.status_code in (400, 409) and "already exists" in r.text:
            return False
        self._check(r)
        return True

    async def delete(self, key: str) -> bool:
        r = await self._request("DELETE", self._path, {"key": key})
        if r.status_code == 404:
            return False
        self._check(r)
        return True

    async def guarded_write(self, guard_key: str, guard_revision: int,
                            puts: Sequence[tuple[str, bytes]] = (),
                            deletes: Sequence[str] = ()) -> int | None:
        check_txn(puts, deletes)
        body = msgpack.packb({"guard_key": guard_key, "guard_revision": int(guard_revision),
                              "puts": [[k, bytes(v)] for k, v in puts],
                              "deletes": list(deletes)})
        r = await self._request("POST", "/txn", {}, body)
        if r.status_code == 412:
            return None
        self._check(r)
        return int(r.text)

    async def grant_lease(self, ttl_s: float) -> LeaseId:
        r = await self._request("POST", "/lease", {"ttl_s": ttl_s})
        self._check(r)
        return LeaseId(int(r.text))

    async def keep_alive(self, lease_id: LeaseId) -> None:
        self._check(await self._request("POST", "/lease/keepalive", {"lease_id": int(lease_id)}))

    async def revoke_lease(self, lease_id: LeaseId) -> None:
        self._check(await self._request("DELETE", "/lease", {"lease_id": int(lease_id)}))

    async def _watch_poll(self, prefix: str, since: int, timeout_s: float) -> dict:
        r = await self._request("GET", "/watch",
                                {"prefix": prefix, "since": since, "timeout_s": timeout_s},
                                timeout_s=timeout_s + self._timeout_s)
        self._check(r)
        payload = msgpack.unpackb(r.content)
        payload["events"] = [WatchEvent(EventKind(kind), key, value, rev)
                             for kind, key, value, rev in payload["events"]]
        return payload

    async def watch_prefix(self, prefix: str) -> _HttpWatch:
        payload = await self._watch_poll(prefix, -1, 0.0)
        return _HttpWatch(self, prefix, int(payload["revision"]))

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            entry = self._clients.pop(id(loop), None)
        if entry is not None:
            await entry[1].aclose()
