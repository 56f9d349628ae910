"""One contract suite for every metadata backend: embedded, http (real server), etcd (real)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator

import pytest

from pymooncake.metadata import (
    EventKind,
    LeaseNotFound,
    MetadataError,
    MetadataStore,
    open_metadata,
)

_ns = itertools.count()


@pytest.fixture(params=["embedded", "http", "etcd"])
def url(request: pytest.FixtureRequest) -> str:
    if request.param == "embedded":
        return f"embedded://contract-{next(_ns)}"
    if request.param == "http":
        return request.getfixturevalue("http_metadata_url")
    return request.getfixturevalue("etcd_url")


@pytest.fixture
def prefix() -> str:
    # Servers are shared across tests; every test gets its own key space.
    return f"t{next(_ns)}-{time.monotonic_ns()}/"


async def _open(url: str) -> MetadataStore:
    return open_metadata(url)


async def _until(pred, timeout_s: float = 5.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not await pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def _next(it: AsyncIterator, timeout_s: float = 5.0):  # noqa: ANN202
    return await asyncio.wait_for(it.__anext__(), timeout=timeout_s)


def test_get_put_delete(url: str, prefix: str) -> None:
    async def main() -> None:
        md = await _open(url)
        try:
            assert await md.get(prefix + "a") is None
            r1 = await md.put(prefix + "a", b"one")
            r2 = await md.put(prefix + "a", b"two")
            assert r2 > r1
            kv = await md.get(prefix + "a")
            assert kv is not None and kv.value == b"two" and kv.mod_revision == r2
            await md.put(prefix + "b", b"\x00\xff" * 3)
            await md.put(prefix + "c/d", b"")
            kvs = await md.get_prefix(prefix)
            assert [(k.key, k.value) for k in kvs] == [
                (prefix + "a", b"two"), (prefix + "b", b"\x00\xff" * 3), (prefix + "c/d", b"")]
            assert await md.delete(prefix + "a") is True
            assert await md.delete(prefix + "a") is False
            assert await md.get(prefix + "a") is None
        finally:
            await md.close()

    asyncio.run(main())


def test_create_is_put_if_absent(url: str, prefix: str) -> None:
    async def main() -> None:
        md = await _open(url)
        try:
            assert await md.create(prefix + "leader", b"A") is True
            assert await md.create(prefix + "leader", b"B") is False
            kv = await md.get(prefix + "leader")
            assert kv is not None and kv.value == b"A"
        finally:
            await md.close()

    asyncio.run(main())


def test_lease_expiry_deletes_keys_and_keepalive_extends(url: str, prefix: str) -> None:
    async def main() -> None:
        md = await _open(url)
        try:
            t0 = time.monotonic()
            short = await md.grant_lease(1.0)
            kept = await md.grant_lease(2.0)    # 2 s: a loaded host may stall ~1 s
            await md.put(prefix + "short", b"x", lease_id=short)
            await md.put(prefix + "kept", b"y", lease_id=kept)
            kv = await md.get(prefix + "short")
            assert kv is not None and kv.lease_id == short

            async def gone() -> bool:
                await md.keep_alive(kept)
                return await md.get(prefix + "short") is None

            await _until(gone, timeout_s=6.0)
            # Expired after its TTL (etcd may round up and expire late, never early).
            assert time.monotonic() - t0 >= 0.95
            while time.monotonic() - t0 < 2.5:  # past kept's first deadline
                await md.keep_alive(kept)
                await asyncio.sleep(0.25)
            assert await md.get(prefix + "kept") is not None
            with pytest.raises(LeaseNotFound):
                await md.keep_alive(short)
            with pytest.raises(LeaseNotFound):
                await md.put(prefix + "late", b"z", lease_id=short)
            await md.revoke_lease(kept)
            assert await md.get(prefix + "kept") is None
        finally:
            await md.close()

    asyncio.run(main())


def test_watch_sees_put_delete_and_expiry(url: str, prefix: str) -> None:
    async def main() -> None:
        md = await _open(url)
        watch = await md.watch_prefix(prefix + "w/")
        try:
            await md.put(prefix + "other", b"not watched")
            await md.put(prefix + "w/1", b"v1")
            ev = await _next(watch)
            assert (ev.kind, ev.key, ev.value) == (EventKind.PUT, prefix + "w/1", b"v1")
            await md.delete(prefix + "w/1")
            ev = await _next(watch)
            assert (ev.kind, ev.key, ev.value) == (EventKind.DELETE, prefix + "w/1", b"")
            lease = await md.grant_lease(1.0)
            await md.put(prefix + "w/2", b"v2", lease_id=lease)
            ev = await _next(watch)
            assert (ev.kind, ev.key) == (EventKind.PUT, prefix + "w/2")
            # No traffic at all: the expiry must still arrive as a delete.
            ev = await _next(watch, timeout_s=6.0)
            assert (ev.kind, ev.key) == (EventKind.DELETE, prefix + "w/2")
        finally:
            await watch.close()
            await md.close()

    asyncio.run(main())


def test_a_lease_kept_alive_then_dropped_expires_on_its_late_deadline(url: str,
                                                                      prefix: str) -> None:
    """Keep-alives move the deadline later without waking the reaper or the watchers
    (``SharedState.run``); the reaper, asleep until the old deadline, must still expire
    the lease at the new one, and a watch must see the deletion without other traffic."""
    async def main() -> None:
        md = await _open(url)
        watch = await md.watch_prefix(prefix + "k/")
        try:
            # A 2 s TTL refreshed every 0.5 s leaves 1.5 s of slack per refresh: a loaded
            # 2-core CI host once stalled this loop past a 1 s TTL refreshed every 0.6 s.
            ttl_s = 2.0
            lease = await md.grant_lease(ttl_s)
            await md.put(prefix + "k/1", b"v", lease_id=lease)
            assert (await _next(watch)).kind is EventKind.PUT
            for _ in range(5):              # 2.5 s in all: past the first deadline
                await asyncio.sleep(0.5)
                sent = time.monotonic()     # the server refreshes after this instant
                await md.keep_alive(lease)
            assert await md.get(prefix + "k/1") is not None
            ev = await _next(watch, timeout_s=8.0)
            assert (ev.kind, ev.key) == (EventKind.DELETE, prefix + "k/1")
            # Not before the extended deadline (5 ms for the clocks' granularity).
            assert time.monotonic() - sent >= ttl_s - 0.005
        finally:
            await watch.close()
            await md.close()

    asyncio.run(main())


def test_unreachable_server_raises_metadata_error() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main() -> None:
        for u in (f"http://127.0.0.1:{port}/metadata", f"etcd://127.0.0.1:{port}"):
            md = open_metadata(u)
            with pytest.raises(MetadataError):
                await md.get("x")

    asyncio.run(main())


def test_open_metadata_rejects_unknown_scheme() -> None:
    with pytest.raises(ValueError, match="unsupported metadata url"):
        open_metadata("redis://127.0.0.1:6379")


@pytest.mark.parametrize("bad", ["etcd://nohost:notaport", "etcd://h:99999",
                                 "http://h:xx/metadata"])
def test_open_metadata_names_the_url_with_a_bad_port(bad: str) -> None:
    with pytest.raises(ValueError, match="bad port") as ei:
        open_metadata(bad)
    assert repr(bad) in str(ei.value)


@pytest.mark.parametrize("bad", [None, 2379, b"etcd://h:1"])
def test_open_metadata_rejects_a_non_string_naming_the_accepted_forms(bad: object) -> None:
    with pytest.raises(TypeError) as ei:
        open_metadata(bad)  # type: ignore[arg-type]
    msg = str(ei.value)
    assert type(bad).__name__ in msg
    for form in ("embedded://", "http://host:port/metadata", "etcd://host:port"):
        assert form in msg


def test_http_server_stop_closes_keep_alive_connections() -> None:
    """A client's pooled connection must not keep talking to a stopped server's state."""
    from pymooncake.metadata.http import MetadataHttpServer

    srv = MetadataHttpServer("127.0.0.1", 0).start()
    md = open_metadata(srv.url)

    async def main() -> None:
        await md.put("k", b"old")
        srv.stop()
        srv2 = MetadataHttpServer("127.0.0.1", srv.port).start()
        try:
            for _ in range(50):  # the first call may see the closed connection
                try:
                    assert await md.get("k") is None  # the new server's empty state
                    break
                except MetadataError:
                    await asyncio.sleep(0.05)
            else:
                raise AssertionError("client never reached the restarted server")
        finally:
            await md.close()
            srv2.stop()

    asyncio.run(main())


def test_leader_election_resign_and_expiry(url: str, prefix: str) -> None:
    from pymooncake.metadata.election import LeaderElection

    async def main() -> None:
        md = await _open(url)
        try:
            key = prefix + "leader"
            # 2 s: refreshed every ttl/3, a lease rides out a ~1 s stall of a loaded host
            a = LeaderElection(md, key, b"A", ttl_s=2.0)
            b = LeaderElection(md, key, b"B", ttl_s=2.0)
            assert await a.campaign(timeout_s=5) is True
            assert await b.campaign(timeout_s=0.2) is False
            assert await b.leader() == b"A" and a.is_leader and not b.is_leader
            # A resigns: B wins at once (woken by the delete).
            waiter = asyncio.create_task(b.campaign(timeout_s=5))
            await asyncio.sleep(0.1)
            await a.resign()
            assert await waiter is True and await a.leader() == b"B"
            # B "crashes" (stops keeping its lease alive): A wins after the TTL.
            await b.abandon()
            assert await a.campaign(timeout_s=6) is True
            assert await a.leader() == b"A"
            await a.resign()
        finally:
            await md.close()

    asyncio.run(main())


def test_guarded_write_is_fenced_by_the_guard_revision(url: str, prefix: str) -> None:
    async def main() -> None:
        md = await _open(url)
        try:
            guard = prefix + "leader"
            r1 = await md.put(guard, b"A")
            await md.put(prefix + "gone", b"x")
            rev = await md.guarded_write(guard, r1, [(prefix + "log/1", b"one"),
                                                     (prefix + "log/2", b"two")],
                                         [prefix + "gone"])
            assert rev is not None and rev > r1
            assert (await md.get(prefix + "log/2")).value == b"two"
            assert await md.get(prefix + "gone") is None
            # a successor rewrote the guard: the old token writes nothing
            r2 = await md.put(guard, b"B")
            assert await md.guarded_write(guard, r1, [(prefix + "log/3", b"x")]) is None
            assert await md.get(prefix + "log/3") is None
            assert await md.guarded_write(guard, r2, [(prefix + "log/3", b"y")]) is not None
            # the guard deleted (lease expired): nothing written either
            await md.delete(guard)
            assert await md.guarded_write(guard, r2, [(prefix + "log/4", b"z")]) is None
            assert await md.get(prefix + "log/4") is None
            with pytest.raises(ValueError, match="at most 128"):
                await md.guarded_write(guard, r2, [(f"{prefix}k{i}", b"") for i in range(129)])
        finally:
            await md.close()

    asyncio.run(main())


def test_election_revision_fences_the_loser(url: str, prefix: str) -> None:
    from pymooncake.metadata.election import LeaderElection

    async def main() -> None:
        md = await _open(url)
        try:
            key = prefix + "leader"
            a = LeaderElection(md, key, b"A", ttl_s=2.0)
            assert await a.campaign(timeout_s=5) is True
            assert a.revision is not None and a.valid()
            assert await md.guarded_write(key, a.revision, [(prefix + "w", b"a")]) is not None
            await a.abandon()  # frozen: its lease runs out
            assert not a.valid()
            b = LeaderElection(md, key, b"B", ttl_s=2.0)
            assert await b.campaign(timeout_s=6) is True
            assert b.revision != a.revision
            assert await md.guarded_write(key, a.revision, [(prefix + "w", b"late")]) is None
            assert (await md.get(prefix + "w")).value == b"a"
            await b.resign()
        finally:
            await md.close()

    asyncio.run(main())


def test_watch_keeps_delivering_after_a_wait_for_times_out(url: str, prefix: str) -> None:
    """HA followers and candidates wait on ``watch.__anext__()`` with a timeout: a timed-out
    wait must not end the watch (an async generator cancelled mid-await is closed for good,
    which made every later wait end at once, and the HA loops spin or reconnect)."""
    async def main() -> None:
        md = await _open(url)
        watch = await md.watch_prefix(prefix + "w/")
        try:
            for i in range(3):
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(watch.__anext__(), timeout=0.2)
                await md.put(prefix + f"w/{i}", b"v")
                ev = await _next(watch)
                assert (ev.kind, ev.key) == (EventKind.PUT, prefix + f"w/{i}")
        finally:
            await watch.close()
            await md.close()

    asyncio.run(main())
