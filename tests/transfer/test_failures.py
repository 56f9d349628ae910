"""Path and peer failures (issue #3 item 6) and the field cases BUG-36, BUG-37, BUG-38."""

from __future__ import annotations

import hashlib
import socket
import time

import numpy as np
import pytest

from pymooncake.obs.metrics import REGISTRY
from pymooncake.transfer import (
    StatusCode,
    TransferConfig,
    TransferEngine,
    TransferOp,
    TransferRequest,
    TransferState,
    aggregate_status,
)
from pymooncake.transfer.transports import tcp
from pymooncake.transfer.transports.tcp import STALE_CHECK_IDLE_S, is_stale
from pymooncake.transfer.transports.wire import TcpConnection

pytestmark = pytest.mark.integration

MiB = 1 << 20
KiB = 1 << 10


def digest(data: np.ndarray | bytes) -> str:
    return hashlib.blake2b(memoryview(data).cast("B"), digest_size=16).hexdigest()


def metric(name: str) -> float:
    return sum(s.value for fam in REGISTRY.collect() for s in fam.samples if s.name == name)


def wait_until_withdrawn(metadata_url: str, segment: str, timeout_s: float) -> float:
    """Seconds until ``segment``'s descriptor is gone from the metadata service."""
    import asyncio

    from pymooncake.metadata import open_metadata
    from pymooncake.transfer import segment_key

    md = open_metadata(metadata_url)
    t0 = time.monotonic()

    async def poll() -> None:
        try:
            while await md.get(segment_key(segment)) is not None:
                assert time.monotonic() - t0 < timeout_s, f"{segment} still published"
                await asyncio.sleep(0.05)
        finally:
            await md.close()

    asyncio.run(poll())
    return time.monotonic() - t0


def make_engine(metadata_url: str, **cfg: object) -> TransferEngine:
    base: dict[str, object] = dict(checksum=True, num_paths=2, min_slice_bytes=64 * KiB,
                                   max_slice_bytes=64 * KiB, window_slices=8,
                                   slice_timeout_s=1.0, connect_timeout_s=0.5,
                                   path_retry_interval_s=0.1, max_retries=3)
    base.update(cfg)
    return TransferEngine(f"a-{time.monotonic_ns()}", metadata_url,
                          config=TransferConfig(**base)).start()  # type: ignore[arg-type]


def test_path_killed_mid_transfer_slices_retried_on_other_path(metadata_url: str,
                                                                spawn_peer) -> None:  # noqa: ANN001
    # The peer drops the first connection that has served 3 wire requests, in the middle
    # of the 4th. A window's 8 contiguous 64 KiB slices of the request are one wire request
    # (tcp.runs): 8 MiB is 16 of them over the 2 connections, so one serves at least 8.
    peer = spawn_peer("flaky", size=8 * MiB, drop_after_slices=3)
    eng = make_engine(metadata_url)
    try:
        src = np.random.default_rng(11).integers(0, 256, 8 * MiB, dtype=np.uint8)
        addr = eng.register_memory(src)
        retries0 = metric("pymooncake_transfer_retries_total")
        t0 = time.monotonic()
        st = eng.transfer_sync(TransferOp.WRITE, addr, peer.name, peer.addr, 8 * MiB)
        assert st.ok, st.reason
        assert peer.digest(peer.addr, 8 * MiB) == digest(src)
        assert metric("pymooncake_transfer_retries_total") > retries0
        assert time.monotonic() - t0 < 5.0
        # Reads after the failure are exact too (the dropped path came back or was bypassed).
        back = np.zeros(8 * MiB, dtype=np.uint8)
        baddr = eng.register_memory(back)
        assert eng.transfer_sync(TransferOp.READ, baddr, peer.name, peer.addr, 8 * MiB).ok
        assert np.array_equal(back, src)
    finally:
        eng.close()


def test_peer_killed_mid_transfer_fails_within_bound(metadata_url: str, spawn_peer) -> None:  # noqa: ANN001
    # The peer serves slowly (5 ms per 64 KiB: 128 slices over 2 paths ≈ 0.3 s) so the
    # kill lands mid-transfer.
    peer = spawn_peer("victim", size=8 * MiB, delay_per_slice_ms=5)
    eng = make_engine(metadata_url)
    try:
        src = np.zeros(8 * MiB, dtype=np.uint8)
        addr = eng.register_memory(src)
        bid = eng.allocate_batch(1)
        eng.submit(bid, [TransferRequest(TransferOp.WRITE, addr, peer.name, peer.addr, 8 * MiB)])
        time.sleep(0.05)
        assert eng.status(bid, 0).state is TransferState.PENDING
        peer.kill()
        t_kill = time.monotonic()
        st = eng.wait(bid, timeout_s=eng.config.failure_bound_s + 2)
        elapsed = time.monotonic() - t_kill
        assert st[0].state is TransferState.FAILED
        assert st[0].code is StatusCode.CONNECTION_ERROR
        assert elapsed <= eng.config.failure_bound_s
        eng.free_batch(bid)
    finally:
        eng.close()


def test_bug_36_stale_connection_after_idle_gap_then_dead_peer(metadata_url: str,
                                                               spawn_peer) -> None:  # noqa: ANN001
    peer = spawn_peer("bug36-b", size=64 * MiB)
    eng = make_engine(metadata_url)
    try:
        buf = np.random.default_rng(36).integers(0, 256, 64 * MiB, dtype=np.uint8)
        addr = eng.register_memory(buf)
        # Step 2: 8 MiB sliced at 64 KiB, byte-exact.
        st = eng.transfer_sync(TransferOp.WRITE, addr, peer.name, peer.addr, 8 * MiB)
        assert st.ok, st.reason
        assert peer.digest(peer.addr, 8 * MiB) == digest(buf[:8 * MiB])
        # Step 3: B closes its side of the pooled connections; an idle gap (0.5 s here,
        # 5 s in the case: only the connections' state matters, not the time).
        assert int(peer.ask("drop")) == 2
        time.sleep(0.5)
        reconnects0 = metric("pymooncake_transfer_stale_reconnects_total")
        # Step 4: OK and byte-exact; the stale connections were detected and reopened.
        st = eng.transfer_sync(TransferOp.WRITE, addr + 8 * MiB, peer.name,
                               peer.addr + 8 * MiB, 8 * MiB)
        assert st.ok, st.reason
        assert peer.digest(peer.addr + 8 * MiB, 8 * MiB) == digest(buf[8 * MiB:16 * MiB])
        assert metric("pymooncake_transfer_stale_reconnects_total") >= reconnects0 + 1
        # Step 5: B stopped completely: failed, explicitly, within the configured bound.
        peer.kill()
        t0 = time.monotonic()
        st = eng.transfer_sync(TransferOp.WRITE, addr, peer.name, peer.addr, 8 * MiB)
        elapsed = time.monotonic() - t0
        assert st.state is TransferState.FAILED
        assert st.code is StatusCode.CONNECTION_ERROR
        assert "queue full" not in st.reason and "connect" in st.reason
        assert elapsed <= eng.config.failure_bound_s
    finally:
        eng.close()


def test_bug_36_connection_closed_right_after_use_is_reopened(
        metadata_url: str, spawn_peer, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """A pooled connection back for less than ``tcp.STALE_CHECK_IDLE_S`` is reused without
    the staleness look (here 60 s: never looked at); one the peer closed meanwhile fails its
    window, which goes again at once on a fresh connection: OK, byte-exact, counted as a
    reconnect and a retry."""
    monkeypatch.setattr(tcp, "STALE_CHECK_IDLE_S", 60.0)
    peer = spawn_peer("bug36-now", size=16 * MiB)
    eng = make_engine(metadata_url, slice_timeout_s=2.0)
    try:
        buf = np.random.default_rng(362).integers(0, 256, 16 * MiB, dtype=np.uint8)
        addr = eng.register_memory(buf)
        assert eng.transfer_sync(TransferOp.WRITE, addr, peer.name, peer.addr, 8 * MiB).ok
        assert int(peer.ask("drop")) == 2
        time.sleep(0.2)  # the peer's FIN has arrived: a look would have seen it
        reconnects0 = metric("pymooncake_transfer_stale_reconnects_total")
        retries0 = metric("pymooncake_transfer_retries_total")
        st = eng.transfer_sync(TransferOp.WRITE, addr + 8 * MiB, peer.name,
                               peer.addr + 8 * MiB, 8 * MiB)
        assert st.ok, st.reason
        assert peer.digest(peer.addr, 16 * MiB) == digest(buf)
        assert metric("pymooncake_transfer_stale_reconnects_total") >= reconnects0 + 1
        assert metric("pymooncake_transfer_retries_total") > retries0  # not looked at
    finally:
        eng.close()


def test_stale_look_is_skipped_for_a_just_released_connection() -> None:
    a, b = socket.socketpair()
    try:
        conn = TcpConnection(a)
        b.close()  # the peer closed: readable (EOF)
        conn.idle_since = time.monotonic()
        assert not is_stale(conn)  # back just now: not looked at
        assert is_stale(conn, min_idle_s=0.0)
        conn.idle_since = time.monotonic() - 2 * STALE_CHECK_IDLE_S
        assert is_stale(conn)
    finally:
        a.close()


def test_bug_37_invalid_fragments_give_non_ok_aggregate(metadata_url: str,
                                                        spawn_peer) -> None:  # noqa: ANN001
    peer = spawn_peer("bug37-b", size=MiB)
    eng = make_engine(metadata_url)
    try:
        src = np.random.default_rng(37).integers(0, 256, MiB, dtype=np.uint8)
        addr = eng.register_memory(src)
        bytes0 = metric("pymooncake_transfer_bytes_total")
        # 1. three fragments, all to an unknown segment: non-OK, zero bytes moved.
        st = eng.batch_transfer_sync([
            TransferRequest(TransferOp.WRITE, addr + i * 4 * KiB, "no-such-segment", 0, 4 * KiB)
            for i in range(3)])
        assert [s.code for s in st] == [StatusCode.NOT_FOUND] * 3
        assert aggregate_status(st).code is StatusCode.NOT_FOUND
        assert sum(s.transferred_bytes for s in st) == 0
        assert metric("pymooncake_transfer_bytes_total") == bytes0
        # 2. valid, out-of-range target offset, unknown segment.
        st = eng.batch_transfer_sync([
            TransferRequest(TransferOp.WRITE, addr, peer.name, peer.addr, 4 * KiB),
            TransferRequest(TransferOp.WRITE, addr, peer.name, peer.addr + MiB, 4 * KiB),
            TransferRequest(TransferOp.WRITE, addr, "no-such-segment", 0, 4 * KiB),
        ])
        assert [s.code for s in st] == [StatusCode.OK, StatusCode.INVALID_ARGUMENT,
                                        StatusCode.NOT_FOUND]
        assert aggregate_status(st).state is TransferState.FAILED
        assert peer.digest(peer.addr, 4 * KiB) == digest(src[:4 * KiB])
        # 3. an empty batch: an OK no-op.
        assert eng.batch_transfer_sync([]) == []
        assert aggregate_status([]).ok
    finally:
        eng.close()


def test_bug_38_bad_source_addresses_refused_at_submit(metadata_url: str,
                                                       spawn_peer) -> None:  # noqa: ANN001
    peer = spawn_peer("bug38-b", size=MiB)
    eng = make_engine(metadata_url)
    try:
        r = np.random.default_rng(38).integers(0, 256, MiB, dtype=np.uint8)
        base = eng.register_memory(r)
        unregistered = np.ones(8 * KiB, dtype=np.uint8)
        before = peer.digest(peer.addr + 8 * KiB, 8 * KiB)
        bid = eng.allocate_batch(4)
        eng.submit(bid, [
            TransferRequest(TransferOp.WRITE, base, peer.name, peer.addr, 4 * KiB),  # (a)
            TransferRequest(TransferOp.WRITE, base + MiB - 100, peer.name,  # (b)
                            peer.addr + 8 * KiB, 4 * KiB),
            TransferRequest(TransferOp.WRITE, unregistered.ctypes.data, peer.name,  # (c)
                            peer.addr + 12 * KiB, 4 * KiB),
            TransferRequest(TransferOp.WRITE, base, peer.name, peer.addr + 16 * KiB, 0),  # (d)
        ])
        # (b), (c) are final the moment submit returns: refused before any network I/O.
        assert eng.status(bid, 1).code is StatusCode.INVALID_ARGUMENT
        assert eng.status(bid, 2).code is StatusCode.INVALID_ARGUMENT
        assert eng.status(bid, 3) .state is TransferState.COMPLETED  # (d) OK no-op
        st = eng.wait(bid, timeout_s=10)
        assert [s.code for s in st] == [StatusCode.OK, StatusCode.INVALID_ARGUMENT,
                                        StatusCode.INVALID_ARGUMENT, StatusCode.OK]
        assert st[3].transferred_bytes == 0
        eng.free_batch(bid)
        assert peer.digest(peer.addr, 4 * KiB) == digest(r[:4 * KiB])  # (a) byte-exact
        assert peer.digest(peer.addr + 8 * KiB, 8 * KiB) == before  # nothing written
        # (e) the engine is still healthy.
        st2 = eng.transfer_sync(TransferOp.WRITE, base + 4 * KiB, peer.name,
                                peer.addr + 4 * KiB, 4 * KiB)
        assert st2.ok
        assert peer.digest(peer.addr + 4 * KiB, 4 * KiB) == digest(r[4 * KiB:8 * KiB])
    finally:
        eng.close()


def test_bug_36_peer_restarted_on_the_same_port(metadata_url: str, spawn_peer) -> None:  # noqa: ANN001
    # A killed engine's name frees up when its lease lapses (segment_ttl_s), not before.
    peer = spawn_peer("bug36-restart", size=8 * MiB, segment_ttl_s=1.0)
    eng = make_engine(metadata_url)
    try:
        buf = np.random.default_rng(361).integers(0, 256, 8 * MiB, dtype=np.uint8)
        addr = eng.register_memory(buf)
        assert eng.transfer_sync(TransferOp.WRITE, addr, peer.name, peer.addr, 8 * MiB).ok
        port = peer.port
        peer.kill()
        wait_until_withdrawn(metadata_url, peer.name, timeout_s=5.0)
        # B restarts with the same name on the same port, with new memory.
        peer2 = spawn_peer("bug36-restart", size=8 * MiB, seed=9, port=port)
        assert peer2.port == port
        reconnects0 = metric("pymooncake_transfer_stale_reconnects_total")
        st = eng.transfer_sync(TransferOp.WRITE, addr, peer2.name, peer2.addr, 8 * MiB)
        assert st.ok, st.reason
        assert peer2.digest(peer2.addr, 8 * MiB) == digest(buf)
        assert metric("pymooncake_transfer_stale_reconnects_total") >= reconnects0 + 1
    finally:
        eng.close()
