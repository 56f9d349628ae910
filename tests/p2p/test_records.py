"""Holder records are never written without a lease (a record without one never expires).

The fault seen from the shell: a plain ``pymooncake p2p get`` sometimes left its holder
record behind with no lease, because ``revoke()`` cleared the lease while a publish queued by
``publish_soon`` was still waiting, and that publish then put the record with
``lease_id=None``. Here the interleaving is forced: a put is held in flight, another publish
is queued behind it, ``revoke()`` runs, then the put is released.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from pymooncake.metadata import open_metadata
from pymooncake.p2p import P2PStore, PullOptions
from pymooncake.p2p.manifest import holder_key, holders_prefix
from pymooncake.p2p.records import HolderRecords

FAST = PullOptions(parallel=4, stall_timeout_s=1.0, retry_backoff_s=0.2, refresh_s=0.05)


class _Recording:
    """A metadata store that logs every put (key, lease) and revoke, and can hold puts."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[tuple[str, str, Any]] = []
        self.put_entered = threading.Event()
        self.revoke_called = threading.Event()
        self.gate: asyncio.Event | None = None      # set: puts wait on it

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def put(self, key: str, value: bytes, *, lease_id: Any = None) -> int:
        self.put_entered.set()
        if self.gate is not None:
            await self.gate.wait()
        self.calls.append(("put", key, lease_id))
        return await self.inner.put(key, value, lease_id=lease_id)

    async def revoke_lease(self, lease_id: Any) -> None:
        self.calls.append(("revoke", "", lease_id))
        self.revoke_called.set()
        await self.inner.revoke_lease(lease_id)


def _records(md: _Recording) -> HolderRecords:
    return HolderRecords(md, "seg-a", 30.0, lambda name: b"record of " + name.encode(),
                         lambda: ["m"])


def _get(rec: HolderRecords, key: str) -> Any:
    return rec.run(rec.metadata.inner.get(key))


def test_publish_queued_behind_a_put_in_flight_is_dropped_by_revoke() -> None:
    md = _Recording(open_metadata(f"embedded://rec-{uuid.uuid4().hex[:8]}"))
    rec = _records(md)
    try:
        rec.start()
        lease = rec._lease
        assert lease is not None

        async def _make_gate() -> None:
            md.gate = asyncio.Event()
        rec.run(_make_gate())
        rec.publish_soon("m")                       # put #1: held in flight by the gate
        assert md.put_entered.wait(5)
        rec.publish_soon("m")                       # queued behind it (coalesced)
        revoker = threading.Thread(target=rec.revoke)
        revoker.start()
        # The old code revoked the lease at once, while put #1 was still in flight; give
        # it the chance (the fixed code waits for the put first, so this times out).
        md.revoke_called.wait(1.0)
        assert md.gate is not None
        rec._loop.call_soon_threadsafe(md.gate.set)  # release put #1
        revoker.join(10)
        assert not revoker.is_alive()
        rec.publish_soon("m")                       # after revoke: dropped
        rec.publish("m")
        rec.run(asyncio.sleep(0.05))                # let any queued publisher run

        puts = [c for c in md.calls if c[0] == "put"]
        assert puts, md.calls
        assert all(lease_id == lease for _, _, lease_id in puts), md.calls   # never None
        revokes = [i for i, c in enumerate(md.calls) if c[0] == "revoke"]
        assert revokes == [len(md.calls) - 1], md.calls    # no put after the revoke
        assert _get(rec, holder_key("m", "seg-a")) is None  # the lease took the record
    finally:
        rec.close()


def test_publish_queued_on_a_busy_loop_when_revoke_starts_is_dropped() -> None:
    """The reporter's interleaving exactly: ``publish_soon`` queues its publisher, the
    loop has not run it yet when ``revoke()`` begins; the old code then put the record
    with ``lease_id=None``."""
    md = _Recording(open_metadata(f"embedded://rec-{uuid.uuid4().hex[:8]}"))
    rec = _records(md)
    try:
        rec.start()
        busy, release = threading.Event(), threading.Event()

        def _block() -> None:           # occupies the loop thread until released
            busy.set()
            release.wait(10)
        rec._loop.call_soon_threadsafe(_block)
        assert busy.wait(5)
        rec.publish_soon("m")           # its publisher is queued on the blocked loop
        revoker = threading.Thread(target=rec.revoke)
        revoker.start()
        deadline = time.monotonic() + 5  # until revoke() has begun (it then waits on the loop)
        while not (rec._lease is None or getattr(rec, "_revoked", False)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        release.set()
        revoker.join(10)
        assert not revoker.is_alive()
        rec.run(asyncio.sleep(0.05))
        assert [c for c in md.calls if c[0] == "put"] == [], md.calls
        assert _get(rec, holder_key("m", "seg-a")) is None
    finally:
        rec.close()


def test_publish_after_revoke_writes_nothing() -> None:
    md = _Recording(open_metadata(f"embedded://rec-{uuid.uuid4().hex[:8]}"))
    rec = _records(md)
    try:
        rec.start()
        rec.publish("m")
        kv = _get(rec, holder_key("m", "seg-a"))
        assert kv is not None and kv.lease_id == rec._lease
        rec.revoke()
        n = len(md.calls)
        rec.publish("m")
        rec.publish_soon("m")
        rec.run(asyncio.sleep(0.05))
        assert md.calls[n:] == []
        assert _get(rec, holder_key("m", "seg-a")) is None
    finally:
        rec.close()


def test_get_replica_then_close_leaves_no_record(tmp_path: Path) -> None:
    """The whole path of ``pymooncake p2p get`` (no --hold): pull, then close at once while
    the last shards' publishes may still be queued. Every holder put carries a lease and
    the receiver's record is gone after close."""
    url = f"embedded://rec-{uuid.uuid4().hex[:8]}"
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "w.bin").write_bytes(bytes(range(256)) * 1200)
    (src / "sub" / "t.json").write_bytes(b"{}" * 5000)
    seed = P2PStore(url, holder_ttl_s=30.0)
    try:
        seed.register("m", [src], shard_bytes=16 * 1024)
        for i in range(5):
            md = _Recording(open_metadata(url))
            peer = P2PStore(md, holder_ttl_s=30.0)
            peer.get_replica("m", tmp_path / f"r{i}", FAST)
            peer.close()
            puts = [c for c in md.calls if c[0] == "put" and c[1].startswith(holders_prefix("m"))]
            assert puts and all(c[2] is not None for c in puts), puts
            hs = seed.holders("m")
            assert [h.segment for h in hs] == [seed.segment], hs
    finally:
        seed.close()
