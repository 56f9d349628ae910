"""A lone sync request of one tcp slice runs without a batch (``transfer/lone.py``,
``TcpPaths.run_one``, issue 16): byte-exact, and under the same failure rules as the batch
path (a broken reused connection is retried, a dead peer fails after its tries, within
the bound)."""

from __future__ import annotations

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
)

pytestmark = pytest.mark.integration

KiB = 1 << 10


def metric(name: str) -> float:
    return sum(s.value for fam in REGISTRY.collect() for s in fam.samples if s.name == name)


def make_engine(metadata_url: str) -> TransferEngine:
    cfg = TransferConfig(checksum=True, num_paths=2, slice_timeout_s=1.0,
                         connect_timeout_s=0.5, path_retry_interval_s=0.1, max_retries=3)
    return TransferEngine(f"lone-{time.monotonic_ns()}", metadata_url, config=cfg).start()


def test_lone_small_requests_are_exact_and_leave_no_batch(metadata_url: str,
                                                          spawn_peer) -> None:  # noqa: ANN001
    peer = spawn_peer("lone-exact", size=1 << 20, seed=5)
    eng = make_engine(metadata_url)
    try:
        dst = np.zeros(64 * KiB, dtype=np.uint8)
        daddr = eng.register_memory(dst)
        slices0 = metric("pymooncake_transfer_slices_total")
        st = eng.transfer_sync(TransferOp.READ, daddr, peer.name, peer.addr + 4096, 64 * KiB)
        assert st.ok and st.transferred_bytes == 64 * KiB, st.reason
        assert np.array_equal(dst, peer.initial_bytes()[4096:4096 + 64 * KiB])
        src = np.random.default_rng(9).integers(0, 256, 64 * KiB, dtype=np.uint8)
        saddr = eng.register_memory(src)
        (st,) = eng.batch_transfer_sync([TransferRequest(TransferOp.WRITE, saddr, peer.name,
                                                         peer.addr, 64 * KiB - 1)])
        assert st.ok and st.transferred_bytes == 64 * KiB - 1, st.reason
        expect = peer.initial_bytes()
        expect[:64 * KiB - 1] = src[:64 * KiB - 1]
        got = np.zeros(1 << 20, dtype=np.uint8)
        assert eng.transfer_sync(TransferOp.READ, eng.register_memory(got), peer.name,
                                 peer.addr, 1 << 20).ok
        assert np.array_equal(got, expect)
        assert metric("pymooncake_transfer_slices_total") >= slices0 + 2
        assert not eng._batches._batches  # the lone ones never made a batch
        # out of the peer's range: refused before any I/O, as on the batch path
        st = eng.transfer_sync(TransferOp.READ, daddr, peer.name, peer.addr + (1 << 20), 16)
        assert st.state is TransferState.FAILED and st.code is StatusCode.INVALID_ARGUMENT
    finally:
        eng.close()


def test_lone_request_survives_a_connection_dropped_mid_slice(metadata_url: str,
                                                              spawn_peer) -> None:  # noqa: ANN001
    # The peer drops the first connection that served 3 slices in the middle of the 4th.
    peer = spawn_peer("lone-flaky", size=1 << 20, drop_after_slices=3)
    eng = make_engine(metadata_url)
    try:
        src = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8)
        saddr = eng.register_memory(src)
        retries0 = metric("pymooncake_transfer_retries_total")
        for i in range(8):  # one after another: each one reuses the pooled connection
            off = i * 64 * KiB
            st = eng.transfer_sync(TransferOp.WRITE, saddr + off, peer.name, peer.addr + off,
                                   64 * KiB)
            assert st.ok, (i, st.reason)
        assert metric("pymooncake_transfer_retries_total") == retries0 + 1
        back = np.zeros(8 * 64 * KiB, dtype=np.uint8)
        assert eng.transfer_sync(TransferOp.READ, eng.register_memory(back), peer.name,
                                 peer.addr, back.nbytes).ok
        assert np.array_equal(back, src[:back.nbytes])
    finally:
        eng.close()


def test_lone_request_to_a_dead_peer_fails_after_its_tries(metadata_url: str,
                                                           spawn_peer) -> None:  # noqa: ANN001
    peer = spawn_peer("lone-dead", size=1 << 20)
    eng = make_engine(metadata_url)
    try:
        buf = np.zeros(64 * KiB, dtype=np.uint8)
        addr = eng.register_memory(buf)
        assert eng.transfer_sync(TransferOp.READ, addr, peer.name, peer.addr, 64 * KiB).ok
        peer.kill()
        t0 = time.monotonic()
        st = eng.transfer_sync(TransferOp.READ, addr, peer.name, peer.addr, 64 * KiB)
        elapsed = time.monotonic() - t0
        assert st.state is TransferState.FAILED
        assert st.code is StatusCode.CONNECTION_ERROR
        assert "connect" in st.reason and "(after 4 tries)" in st.reason, st.reason
        assert elapsed <= eng.config.failure_bound_s
        assert not eng._batches._batches
    finally:
        eng.close()


def test_reply_polling_window(metadata_url: str, spawn_peer) -> None:  # noqa: ANN001
    """A path polls ``reply_poll_s`` for a window's replies before it sleeps: a reply inside
    the window (the peer takes 4 ms a slice), after it (16 slices: 32 ms), and without
    polling (0) all land exactly; the window is bounded."""
    with pytest.raises(ValueError, match="reply_poll_s"):
        TransferConfig(reply_poll_s=-1.0)
    with pytest.raises(ValueError, match="reply_poll_s"):
        TransferConfig(reply_poll_s=1.0)
    peer = spawn_peer("lone-slow", size=1 << 20, seed=8, delay_per_slice_ms=4)
    for poll_s in (0.0, 0.01):
        eng = TransferEngine(f"poll-{time.monotonic_ns()}", metadata_url, config=TransferConfig(
            checksum=True, reply_poll_s=poll_s)).start()
        try:
            dst = np.zeros(1 << 20, dtype=np.uint8)
            daddr = eng.register_memory(dst)
            st = eng.transfer_sync(TransferOp.READ, daddr, peer.name, peer.addr, 64 * KiB)
            assert st.ok, st.reason
            st = eng.transfer_sync(TransferOp.READ, daddr, peer.name, peer.addr, 1 << 20)
            assert st.ok, st.reason
            assert np.array_equal(dst, peer.initial_bytes())
        finally:
            eng.close()
