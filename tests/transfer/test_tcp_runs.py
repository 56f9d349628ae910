"""Contiguous slices of one request share a wire request (``tcp.runs``), against a real
``TcpDataServer`` on loopback: the bytes are exact both ways with CRCs on, the server
serves one request per run (its ``on_slice`` hook), every slice gets its run's answer
(a refused run: each slice refused), and slices that do not continue each other are
never merged. Issue 16: the 16 MiB tcp figure lost ~0.1 CPU-s/GiB to per-request costs
at 1 MiB slices."""

from __future__ import annotations

import numpy as np
import pytest

from pymooncake.transfer.batch import StatusCode, TransferOp
from pymooncake.transfer.memory import MemoryRegion, MemoryRegistry
from pymooncake.transfer.transports.base import Slice
from pymooncake.transfer.transports.tcp import open_connection, run_window, runs
from pymooncake.transfer.transports.tcp_server import TcpDataServer

KiB = 1024


def _slices(op: TransferOp, local: np.ndarray, target_addr: int, piece: int,
            request_index: int = 0, local_off: int = 0, target_off: int = 0,
            count: int = 4) -> list[Slice]:
    view = memoryview(local)
    base = local.ctypes.data
    return [Slice(op, base + local_off + k * piece, target_addr + target_off + k * piece,
                  piece, 1, request_index,
                  view=view[local_off + k * piece:local_off + (k + 1) * piece])
            for k in range(count)]


def test_runs_merge_only_slices_that_continue_each_other() -> None:
    buf = np.zeros(64 * KiB, dtype=np.uint8)
    a = _slices(TransferOp.WRITE, buf, 1 << 20, 4 * KiB, count=3)
    assert runs(a) == [(0, 3, 12 * KiB)]
    # another request right behind it: its own run, though the addresses continue
    b = _slices(TransferOp.WRITE, buf, 1 << 20, 4 * KiB, request_index=1,
                local_off=12 * KiB, target_off=12 * KiB, count=2)
    assert runs(a + b) == [(0, 3, 12 * KiB), (3, 2, 8 * KiB)]
    # a gap on the target side, or on the local side, or a change of op: a new run
    gap_t = _slices(TransferOp.WRITE, buf, 1 << 20, 4 * KiB, local_off=12 * KiB,
                    target_off=16 * KiB, count=1)
    assert runs(a + gap_t) == [(0, 3, 12 * KiB), (3, 1, 4 * KiB)]
    gap_l = _slices(TransferOp.WRITE, buf, 1 << 20, 4 * KiB, local_off=16 * KiB,
                    target_off=12 * KiB, count=1)
    assert runs(a + gap_l) == [(0, 3, 12 * KiB), (3, 1, 4 * KiB)]
    rd = _slices(TransferOp.READ, buf, 1 << 20, 4 * KiB, local_off=12 * KiB,
                 target_off=12 * KiB, count=1)
    assert runs(a + rd) == [(0, 3, 12 * KiB), (3, 1, 4 * KiB)]
    # the cap: no run longer than max_bytes
    assert runs(a, max_bytes=8 * KiB) == [(0, 2, 8 * KiB), (2, 1, 4 * KiB)]
    assert runs([]) == []


@pytest.fixture
def target() -> tuple[TcpDataServer, np.ndarray, list[tuple[int, int]]]:
    mem = np.zeros(2 << 20, dtype=np.uint8)
    reg = MemoryRegistry()
    reg.add(MemoryRegion(mem.ctypes.data, mem.nbytes, mem))
    server = TcpDataServer("127.0.0.1", 0, reg)
    seen: list[tuple[int, int]] = []
    server.on_slice = lambda op, length: seen.append((op, length))
    yield server, mem, seen
    server.close()


def test_a_run_moves_exact_bytes_both_ways_in_one_request(target) -> None:
    server, mem, seen = target
    conn = open_connection("127.0.0.1", server.port, 2.0, 5.0)
    try:
        rng = np.random.default_rng(16)
        src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
        piece = 256 * KiB
        taddr = mem.ctypes.data + 512 * KiB
        writes = _slices(TransferOp.WRITE, src, taddr, piece)
        assert run_window(conn, writes, True, 1) == [(StatusCode.OK, "")] * 4
        assert np.array_equal(mem[512 * KiB:512 * KiB + (1 << 20)], src)
        assert seen == [(int(TransferOp.WRITE), 1 << 20)]  # one request for 4 slices

        dst = np.zeros(1 << 20, dtype=np.uint8)
        seen.clear()
        reads = _slices(TransferOp.READ, dst, taddr, piece)
        assert run_window(conn, reads, True, 5, poll_s=0.001) == [(StatusCode.OK, "")] * 4
        assert np.array_equal(dst, src)
        assert seen == [(int(TransferOp.READ), 1 << 20)]

        # two requests in one window: two runs, two wire requests, both exact
        dst[:] = 0
        seen.clear()
        two = (_slices(TransferOp.READ, dst, taddr, piece, count=2)
               + _slices(TransferOp.READ, dst, taddr, piece, request_index=1,
                         local_off=2 * piece, target_off=2 * piece, count=2))
        assert run_window(conn, two, True, 9) == [(StatusCode.OK, "")] * 4
        assert np.array_equal(dst, src)
        assert seen == [(int(TransferOp.READ), 2 * piece)] * 2
    finally:
        conn.close()


def test_a_refused_run_refuses_each_of_its_slices(target) -> None:
    server, mem, seen = target
    conn = open_connection("127.0.0.1", server.port, 2.0, 5.0)
    try:
        src = np.ones(512 * KiB, dtype=np.uint8)
        # the run's second half lies past the registered buffer: the whole run is refused
        # before a byte is written, and the session ends (FLAG_CLOSING) with its last slice
        taddr = mem.ctypes.data + mem.nbytes - 256 * KiB
        out = run_window(conn, _slices(TransferOp.WRITE, src, taddr, 128 * KiB), False, 1)
        assert len(out) == 4
        assert {code for code, _ in out} == {StatusCode.INVALID_ARGUMENT}
        assert "outside every registered buffer" in out[0][1]
        assert conn.closed_by_peer
        assert not mem.any()
        assert seen == []
    finally:
        conn.close()


def test_the_target_never_writes_a_range_unregistered_since_its_last_request() -> None:
    """The target reuses the previous request's region only while its registry is the same
    snapshot: after an unregister, a request into that memory is refused (BUG-64)."""
    mem = np.zeros(1 << 20, dtype=np.uint8)
    reg = MemoryRegistry()
    reg.add(MemoryRegion(mem.ctypes.data, mem.nbytes, mem))
    server = TcpDataServer("127.0.0.1", 0, reg)
    conn = open_connection("127.0.0.1", server.port, 2.0, 5.0)
    try:
        src = np.full(64 * KiB, 5, dtype=np.uint8)
        one = _slices(TransferOp.WRITE, src, mem.ctypes.data, 64 * KiB, count=1)
        assert run_window(conn, one, True, 1) == [(StatusCode.OK, "")]
        assert int(mem[:64 * KiB].sum()) == 5 * 64 * KiB
        reg.remove(mem.ctypes.data)
        src[:] = 9
        (code, msg), = run_window(conn, one, True, 2)
        assert code is StatusCode.INVALID_ARGUMENT and "outside every registered" in msg
        assert int(mem[:64 * KiB].sum()) == 5 * 64 * KiB  # untouched
    finally:
        conn.close()
        server.close()
