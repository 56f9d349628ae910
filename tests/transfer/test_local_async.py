"""local/shm requests of ``submit`` are copied on the engine's copy thread, not inline."""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest

from pymooncake.transfer import TransferEngine, TransferOp, TransferRequest, TransferState
from pymooncake.transfer.transports import local as local_transport

_ns = itertools.count()
MiB = 1 << 20


@pytest.fixture
def engine():  # noqa: ANN201
    eng = TransferEngine("solo", f"embedded://local-async-{next(_ns)}").start()
    try:
        yield eng
    finally:
        eng.close()


def test_submit_returns_before_a_slow_copy_and_the_copy_runs_elsewhere(
        engine: TransferEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    real_copy = local_transport.copy
    threads: list[str] = []

    def slow_copy(op, local_addr, target_addr, length) -> None:  # noqa: ANN001
        threads.append(threading.current_thread().name)
        time.sleep(0.3)
        real_copy(op, local_addr, target_addr, length)

    monkeypatch.setattr(local_transport, "copy", slow_copy)
    src = np.random.default_rng(1).integers(0, 256, 4 * MiB, dtype=np.uint8)
    dst = np.zeros(4 * MiB, dtype=np.uint8)
    s, d = engine.register_memory(src), engine.register_memory(dst)
    bid = engine.allocate_batch(2)
    t0 = time.monotonic()
    engine.submit(bid, [TransferRequest(TransferOp.WRITE, s, "solo", d, 2 * MiB),
                        TransferRequest(TransferOp.READ, s + 2 * MiB, "solo", d + 2 * MiB,
                                        2 * MiB)])
    assert time.monotonic() - t0 < 0.2  # the caller's thread did not copy
    assert engine.status(bid, 0).state is TransferState.PENDING
    st = engine.wait(bid, timeout_s=5)
    engine.free_batch(bid)
    assert all(x.ok for x in st) and [x.transferred_bytes for x in st] == [2 * MiB] * 2
    assert np.array_equal(dst[:2 * MiB], src[:2 * MiB])
    assert np.array_equal(src[2 * MiB:], dst[2 * MiB:])  # READ: target -> local
    assert threads and all(name == "transfer-copy-solo" for name in threads)
    assert threading.current_thread().name not in threads


def test_pending_copies_end_when_the_engine_closes(engine: TransferEngine) -> None:
    buf = np.zeros(2 * MiB, dtype=np.uint8)
    a = engine.register_memory(buf)
    bid = engine.allocate_batch(1)
    engine.submit(bid, [TransferRequest(TransferOp.WRITE, a, "solo", a + MiB, MiB)])
    engine.close()  # the queued copy still runs (memory is live) or ends "engine closed"
    assert engine.status(bid, 0).state is not TransferState.PENDING
