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


def test_a_small_submission_is_copied_inline_while_the_copy_thread_is_idle(
        engine: TransferEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Below ``inline_copy_max_bytes`` the caller's thread copies (no wake-up of the copy
    thread); a small submission behind a queued large one still waits its turn there."""
    real_copy = local_transport.copy
    threads: list[tuple[str, int]] = []

    def tracing_copy(op, local_addr, target_addr, length) -> None:  # noqa: ANN001
        threads.append((threading.current_thread().name, length))
        if length >= MiB:
            time.sleep(0.2)
        real_copy(op, local_addr, target_addr, length)

    monkeypatch.setattr(local_transport, "copy", tracing_copy)
    small = engine.config.inline_copy_max_bytes
    assert small >= 4096
    src = np.random.default_rng(2).integers(0, 256, 4 * MiB, dtype=np.uint8)
    dst = np.zeros(4 * MiB, dtype=np.uint8)
    s, d = engine.register_memory(src), engine.register_memory(dst)
    bid = engine.allocate_batch(1)
    engine.submit(bid, [TransferRequest(TransferOp.WRITE, s, "solo", d, small)])
    assert engine.status(bid, 0).state is TransferState.COMPLETED   # done on return
    assert threads == [(threading.current_thread().name, small)]
    engine.free_batch(bid)
    assert np.array_equal(dst[:small], src[:small])
    threads.clear()
    bid = engine.allocate_batch(2)   # a large copy queued: the small one must not overtake
    engine.submit(bid, [TransferRequest(TransferOp.WRITE, s, "solo", d + MiB, 2 * MiB)])
    engine.submit(bid, [TransferRequest(TransferOp.WRITE, s + 2 * MiB, "solo", d + MiB, 4096)])
    st = engine.wait(bid, timeout_s=5)
    engine.free_batch(bid)
    assert all(x.ok for x in st)
    assert [n for n, _ in threads] == ["transfer-copy-solo"] * 2
    assert [n for _, n in threads] == [2 * MiB, 4096]
    assert np.array_equal(dst[MiB:MiB + 4096], src[2 * MiB:2 * MiB + 4096])  # the later one won


def test_a_failing_inline_copy_is_a_failed_status_not_an_exception(
        engine: TransferEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(op, local_addr, target_addr, length) -> None:  # noqa: ANN001
        raise OSError("bad mapping")

    monkeypatch.setattr(local_transport, "copy", broken)
    buf = np.zeros(64 * 1024, dtype=np.uint8)
    a = engine.register_memory(buf)
    bid = engine.allocate_batch(1)
    assert engine.submit(bid, [TransferRequest(TransferOp.WRITE, a, "solo", a + 4096, 4096)]) == 0
    st = engine.wait(bid, timeout_s=5)
    engine.free_batch(bid)
    assert st[0].state is TransferState.FAILED and "bad mapping" in st[0].reason
