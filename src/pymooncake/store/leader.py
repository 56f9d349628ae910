"""How a Store client finds and follows the master leader (HA masters, docs/store.md).

``master`` forms accepted by ``StoreClient`` (and ``--master``):

* ``host:port`` — one master (no fail-over);
* ``host1:port1,host2:port2,...`` — an HA set: on a refused connection the next one is
  tried, and a follower's refusal names the leader, which is tried next;
* ``etcd://host:port[/cluster_id]`` — an HA set found through the leader key in etcd
  (``pymooncake/store/<cluster_id>/leader``, cluster ``default`` when omitted).

``LeaderSyncRpc`` and ``LeaderRpc`` are drop-in replacements of ``SyncRpcClient`` and
``RpcClient`` that follow the leader: a call refused with ``UNAVAILABLE_IN_CURRENT_STATUS``
(a follower, or a leader that stepped down) or that cannot connect is sent again to the
leader for up to ``failover_timeout_s``. A call whose connection broke after it was sent
(or that timed out) may have run: calls that are safe to repeat (``IDEMPOTENT``) are sent
again; the others only to a *different* master that leads now (a new leader never keeps an
unfinished put of its predecessor, so a repeated ``put_start`` there cannot collide with
the first one), else they raise as before.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from pymooncake.obs.logging import init_logger
from pymooncake.rpc import RpcClient, RpcConnectionError, RpcError, RpcTimeout, SyncRpcClient

logger = init_logger(__name__)

IDEMPOTENT: frozenset[str] = frozenset({
    "ping", "ha_status", "heartbeat", "mount_segment", "get_replica_list",
    "batch_get_replica_list", "load_replica_list", "exist", "batch_exist", "get_size", "put_end",
    "batch_put_end", "list_keys", "stats", "release_leases"})
"""Master calls that may be sent twice (``put_end`` is idempotent for its writer)."""

REFUSED = "UNAVAILABLE_IN_CURRENT_STATUS"


def _addr(text: str, given: str | None = None, form: str = "host:port") -> tuple[str, int]:
    """``text`` (one address of the user's ``given``) as ``(host, port)``; the error
    echoes ``given`` as typed and the ``form`` it should have had."""
    given = text if given is None else given
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        part = f" ({text.strip()!r} is not host:port)" if text.strip() != given.strip() else ""
        raise ValueError(f"master address {given!r}: expected {form}{part}")
    return host, int(port)


class MasterLocator:
    """Where the master leader is; thread-safe. Raises ``ValueError`` for a malformed
    ``master`` (see the module docstring for its forms)."""

    def __init__(self, master: str) -> None:
        if not isinstance(master, str) or not master.strip():
            raise ValueError(f"master address {master!r}: expected host:port, "
                             "host:port,host:port or etcd://host:port[/cluster_id]")
        self.spec = master.strip()
        self.etcd_url: str | None = None
        self.leader_key = ""
        self.addrs: list[tuple[str, int]] = []
        if self.spec.startswith("etcd://"):
            parts = urlsplit(self.spec)
            cluster = parts.path.strip("/") or "default"
            if not parts.netloc or "/" in cluster:
                raise ValueError(f"master address {master!r}: expected "
                                 "etcd://host:port[/cluster_id]")
            for hp in parts.netloc.split(","):
                _addr(hp, master, "etcd://host:port[/cluster_id]")
            self.etcd_url = f"etcd://{parts.netloc}"
            self.leader_key = f"pymooncake/store/{cluster}/leader"
        else:
            form = "host:port" if "," not in self.spec else "host:port,host:port"
            self.addrs = [_addr(a, master, form) for a in self.spec.split(",")]
        self.ha = self.etcd_url is not None or len(self.addrs) > 1
        self._current: tuple[str, int] | None = self.addrs[0] if self.addrs else None
        self._lock = threading.Lock()
        self._md: Any = None  # the etcd client, used on the lookup thread's loop only

    def first(self) -> tuple[str, int]:
        """The address to show before any lookup (``("", 0)`` with etcd)."""
        return self._current or ("", 0)

    def peek(self) -> tuple[str, int] | None:
        """The address in use now, without any lookup (one attribute read, atomic: no lock
        on every master call's path)."""
        return self._current

    def current(self) -> tuple[str, int] | None:
        """The address to call now (looked up in etcd when none is known yet)."""
        with self._lock:
            cur = self._current
        if cur is None and self.etcd_url is not None:
            found = self._from_etcd()
            with self._lock:
                if self._current is None:
                    self._current = found
                cur = self._current
        return cur

    def failover(self, failed: tuple[str, int], hint: str = "") -> None:
        """``failed`` refused or is unreachable; move to ``hint`` (a follower's answer),
        else to the leader in etcd, else to the next address of the list."""
        with self._lock:
            if self._current is not None and self._current != failed:
                return  # another thread moved on already
        new: tuple[str, int] | None = None
        if hint:
            try:
                new = _addr(hint)
            except ValueError:
                new = None
        if new is None and self.etcd_url is not None:
            new = self._from_etcd()
        if new is None and self.addrs:
            i = self.addrs.index(failed) if failed in self.addrs else -1
            new = self.addrs[(i + 1) % len(self.addrs)]
        with self._lock:
            if new is not None and new != self._current:
                logger.info("store master: following the leader to %s:%d", *new)
            self._current = new if new is not None else self._current

    def _from_etcd(self) -> tuple[str, int] | None:
        from pymooncake.metadata import open_metadata
        from pymooncake.store.master.ha import leader_address

        async def look() -> str | None:
            if self._md is None:
                self._md = open_metadata(self.etcd_url or "")
            kv = await asyncio.wait_for(self._md.get(self.leader_key), 4.0)
            return leader_address(kv.value if kv is not None else None)

        try:  # on the lookup thread's loop: callers may be inside an event loop
            found = asyncio.run_coroutine_threadsafe(look(), _lookup_loop()).result(5.0)
        except Exception as e:  # noqa: BLE001 - etcd unreachable: keep what we have
            logger.debug("leader lookup in %s failed: %r", self.etcd_url, e)
            return None
        return _addr(found) if found else None


AMBIGUOUS = "?"
"""Retry hint: the call may have run; repeat it only on another master."""


_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def _lookup_loop() -> asyncio.AbstractEventLoop:
    """One event loop thread for every locator's etcd lookups in this process (the gRPC
    client behind etcd wants one long-lived loop, not a fresh one per lookup)."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="store-leader-lookup",
                             daemon=True).start()
            _LOOP = loop
        return _LOOP


def _retry_hint(method: str, e: RpcError) -> str | None:
    """The leader hint to retry with (``""``: unknown, ``AMBIGUOUS``: only elsewhere), or
    ``None``: do not retry."""
    if e.code == REFUSED and isinstance(e.data, dict) and "leader" in e.data:
        return str(e.data.get("leader") or "")
    if isinstance(e, RpcConnectionError | RpcTimeout):
        if (isinstance(e, RpcConnectionError) and "cannot connect" in e.message) \
                or method in IDEMPOTENT:
            return ""
        return AMBIGUOUS
    return None


class _Attempts:
    """Retry bookkeeping of one call: the masters it may already have run on."""

    def __init__(self, failover_timeout_s: float, start: float | None = None) -> None:
        self.deadline = (time.monotonic() if start is None else start) + failover_timeout_s
        self.ran_on: set[tuple[str, int]] = set()
        self.first: RpcError | None = None

    def next_hint(self, method: str, addr: tuple[str, int] | None, err: RpcError,
                  ha: bool) -> str | None:
        """The hint to fail over with, or ``None``: raise (see ``raise_error``)."""
        hint = _retry_hint(method, err) if ha else None
        if hint == AMBIGUOUS and addr is not None:
            self.ran_on.add(addr)
            self.first = self.first or err
            hint = ""
        if hint is None or time.monotonic() >= self.deadline:
            return None
        return hint

    def blocked(self, addr: tuple[str, int] | None) -> bool:
        """True when the call may already have run on ``addr``: do not send it again."""
        return addr is not None and addr in self.ran_on

    def raise_error(self, err: RpcError) -> None:
        raise self.first or err


class LeaderSyncRpc:
    """A ``SyncRpcClient`` that follows the leader of ``locator`` (see module docstring)."""

    def __init__(self, locator: MasterLocator, timeout_s: float = 5.0,
                 failover_timeout_s: float = 10.0) -> None:
        self.locator, self.timeout_s = locator, timeout_s
        self.failover_timeout_s = failover_timeout_s
        self._rpc: SyncRpcClient | None = None
        self._addr: tuple[str, int] | None = None

    def _client(self, addr: tuple[str, int]) -> SyncRpcClient:
        if self._rpc is None or self._addr != addr:
            if self._rpc is not None:
                self._rpc.close()
            self._rpc, self._addr = SyncRpcClient(addr[0], addr[1], self.timeout_s), addr
        return self._rpc

    def call(self, method: str, params: Any = None, timeout_s: float | None = None,
             failover_s: float | None = None, reply_type: Any = None) -> Any:
        """``SyncRpcClient.call`` on the leader; raises the last ``RpcError`` when no
        leader answers within ``failover_s`` (default ``failover_timeout_s``; at once
        without HA)."""
        t0 = time.monotonic()
        bound = self.failover_timeout_s if failover_s is None else failover_s
        rpc, addr = self._rpc, self._addr
        if rpc is not None and addr is not None and addr == self.locator.peek():
            try:  # the usual case, the known leader answers: no bookkeeping before a failure
                return rpc.call(method, params, timeout_s, reply_type)
            except RpcError as e:
                tries = _Attempts(bound, t0)
                self._failed(method, addr, e, tries)
        else:
            tries = _Attempts(bound, t0)
        while True:
            addr = self.locator.current()
            if addr is None:
                err: RpcError = RpcConnectionError(
                    f"{method}: no master leader found in {self.locator.spec}")
            elif tries.blocked(addr):
                err = tries.first or RpcConnectionError(f"{method}: no other leader")
            else:
                try:
                    return self._client(addr).call(method, params, timeout_s, reply_type)
                except RpcError as e:
                    err = e
            self._failed(method, addr, err, tries)

    def begin(self, method: str, params: Any = None) -> Callable[..., Any] | None:
        """``SyncRpcClient.begin`` on the known leader: the call sent, its ``finish``
        returned; ``None`` (nothing sent) when no leader is known yet or the send failed
        — the caller then makes the call with ``call``, which fails over. ``finish``
        raises ``RpcError`` without failing over: an idempotent call is made again with
        ``call``."""
        rpc, addr = self._rpc, self._addr
        if rpc is None or addr is None or addr != self.locator.peek():
            return None
        try:
            return rpc.begin(method, params)
        except RpcError:
            return None

    def _failed(self, method: str, addr: tuple[str, int] | None, err: RpcError,
                tries: _Attempts) -> None:
        """After a failed try: raise ``err`` (or the first possibly-run call's error), or
        fail over, pausing when no other leader is known yet."""
        hint = tries.next_hint(method, addr, err, self.locator.ha)
        if hint is None:
            tries.raise_error(err)
        if addr is not None:
            self.locator.failover(addr, hint)
        if self.locator.peek() == addr or not hint:
            time.sleep(0.1)

    def close(self) -> None:
        if self._rpc is not None:
            self._rpc.close()


class LeaderRpc:
    """An asyncio ``RpcClient`` that follows the leader of ``locator``."""

    def __init__(self, locator: MasterLocator, timeout_s: float = 5.0,
                 failover_timeout_s: float = 10.0) -> None:
        self.locator, self.timeout_s = locator, timeout_s
        self.failover_timeout_s = failover_timeout_s
        self._rpc: RpcClient | None = None
        self._addr: tuple[str, int] | None = None

    async def _client(self, addr: tuple[str, int]) -> RpcClient:
        if self._rpc is None or self._addr != addr:
            if self._rpc is not None:
                await self._rpc.close()
            self._rpc, self._addr = RpcClient(addr[0], addr[1], timeout_s=self.timeout_s), addr
        return self._rpc

    async def call(self, method: str, params: Any = None, timeout_s: float | None = None,
                   reply_type: Any = None) -> Any:
        """``RpcClient.call`` on the leader (same rules as ``LeaderSyncRpc.call``)."""
        tries = _Attempts(self.failover_timeout_s)
        while True:
            addr = await asyncio.to_thread(self.locator.current)
            if addr is None:
                err = RpcConnectionError(
                    f"{method}: no master leader found in {self.locator.spec}")
            elif tries.blocked(addr):
                err = tries.first or RpcConnectionError(f"{method}: no other leader")
            else:
                try:
                    return await (await self._client(addr)).call(method, params, timeout_s,
                                                                  reply_type)
                except RpcError as e:
                    err = e
            hint = tries.next_hint(method, addr, err, self.locator.ha)
            if hint is None:
                tries.raise_error(err)
            if addr is not None:
                await asyncio.to_thread(self.locator.failover, addr, hint)
            if self.locator.peek() == addr or not hint:
                await asyncio.sleep(0.1)

    async def close(self) -> None:
        if self._rpc is not None:
            await self._rpc.close()
