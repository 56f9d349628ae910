"""P→D KV writes to a peer that stops answering (issue 17 Build items 5, 6): the wait of a
prefill worker's engine thread (``engine.kv_writes.KVWrites``) ends at once when the
request is aborted, or at its deadline, long before the Transfer Engine's own failure
bound; the batch given up is freed once its slices end. The peer is a real process frozen
with SIGSTOP (its socket accepts nothing more: frames go unanswered, as on a partition)."""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest

from pymooncake.engine.kv_writes import POLL_S, KVWrites
from pymooncake.transfer import TransferConfig, TransferEngine, TransferOp, TransferRequest

pytestmark = pytest.mark.integration

MiB = 1 << 20


def make_engine(metadata_url: str) -> TransferEngine:
    cfg = TransferConfig(num_paths=2, min_slice_bytes=64 << 10, max_slice_bytes=64 << 10,
                         window_slices=8, slice_timeout_s=1.0, connect_timeout_s=0.5,
                         path_retry_interval_s=0.1, max_retries=3)
    return TransferEngine(f"p-{time.monotonic_ns()}", metadata_url, config=cfg).start()


def _frozen_write(metadata_url: str, spawn_peer):  # noqa: ANN001, ANN202
    peer = spawn_peer("frozen", size=8 * MiB)
    eng = make_engine(metadata_url)
    src = np.ones(8 * MiB, dtype=np.uint8)
    addr = eng.register_memory(src)
    # warm the paths up (connections open), then freeze the peer mid-conversation
    assert eng.transfer_sync(TransferOp.WRITE, addr, peer.name, peer.addr, MiB).ok
    peer.proc.send_signal(signal.SIGSTOP)
    bid = eng.allocate_batch(1)
    eng.submit(bid, [TransferRequest(TransferOp.WRITE, addr, peer.name, peer.addr, 8 * MiB)])
    return peer, eng, bid


def test_abort_ends_the_wait_for_a_write_to_a_frozen_peer(metadata_url, spawn_peer):  # noqa: ANN001
    peer, eng, bid = _frozen_write(metadata_url, spawn_peer)
    writes = KVWrites(eng)
    try:
        threading.Timer(0.3, writes.cancel, args=("req-1",)).start()  # the abort RPC
        t0 = time.monotonic()
        statuses, why = writes.wait_for(bid, ("req-1",), timeout_s=30.0)
        waited = time.monotonic() - t0
        assert statuses is None and "aborted" in why
        assert 0.3 <= waited < 0.3 + 4 * POLL_S + 0.3, waited
        assert waited < eng.config.failure_bound_s / 4   # what it did not sit out (4.4 s)
        # given up, not freed under its slices: the reaper frees it once they end
        t1 = time.monotonic()
        while eng._batches._batches.get(bid) is not None:     # noqa: SLF001
            assert time.monotonic() - t1 < eng.config.failure_bound_s + 3, "never freed"
            time.sleep(0.1)
        assert writes.num_abandoned == 1
    finally:
        peer.proc.send_signal(signal.SIGCONT)
        writes.close()
        eng.close()


def test_write_to_a_frozen_peer_gives_up_at_its_deadline(metadata_url, spawn_peer):  # noqa: ANN001
    peer, eng, bid = _frozen_write(metadata_url, spawn_peer)
    writes = KVWrites(eng)
    try:
        t0 = time.monotonic()
        statuses, why = writes.wait_for(bid, ("req-2",), timeout_s=1.5)
        waited = time.monotonic() - t0
        assert statuses is None and "not done in 2 s" in why
        assert 1.5 <= waited < 1.5 + 0.5, waited
        # another request's write to a live peer is not held up by the frozen one's
        other = spawn_peer("alive", size=MiB)
        src = np.full(MiB, 7, dtype=np.uint8)
        addr = eng.register_memory(src)
        b2 = eng.allocate_batch(1)
        eng.submit(b2, [TransferRequest(TransferOp.WRITE, addr, other.name, other.addr, MiB)])
        statuses, why = writes.wait_for(b2, ("req-3",), timeout_s=5.0)
        assert why == "" and statuses is not None and statuses[0].ok
    finally:
        peer.proc.send_signal(signal.SIGCONT)
        writes.close()
        eng.close()


def test_deferred_write_to_a_frozen_peer_is_given_up_then_final_once_its_slices_end(
        metadata_url, spawn_peer):  # noqa: ANN001
    """``KVWrites.defer``: the caller is told at the deadline (it answers its request with an
    error at once) but the batch is only reported final — its memory free for reuse — once
    the Transfer Engine has ended every slice of it."""
    peer, eng, bid = _frozen_write(metadata_url, spawn_peer)
    writes = KVWrites(eng)
    told: list[tuple[float, object, str]] = []
    final: list[float] = []
    try:
        t0 = time.monotonic()
        writes.defer(bid, ("req-4",), t0 + 0.5,
                     lambda st, why: told.append((time.monotonic() - t0, st, why)),
                     lambda: final.append(time.monotonic() - t0))
        while not final and time.monotonic() - t0 < eng.config.failure_bound_s + 3:
            time.sleep(0.05)
        assert len(told) == 1 and told[0][1] is None and "not done in time" in told[0][2]
        assert 0.5 <= told[0][0] < 0.5 + 4 * POLL_S + 0.3, told
        assert final, "the deferred batch never became final"
        assert final[0] > told[0][0] + 1.0          # its slices ended well after the deadline
        assert eng._batches._batches.get(bid) is None   # noqa: SLF001 - freed
    finally:
        peer.proc.send_signal(signal.SIGCONT)
        writes.close()
        eng.close()
