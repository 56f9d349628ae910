"""The ``cma`` transport's guards on this process's own anchor: the token, the name
digest and the snapshot of registered ranges (``transports/cma.py``), the peer cache
(``transports/cma_peers.py``), the copy errors, and the descriptor's ``cma`` entry. The
cases a live peer cannot be made to show (a reused pid, a snapshot freed while read) are
here; tests/transfer/test_cma.py drives real peer processes.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time

import numpy as np
import pytest

from pymooncake.transfer import TransferOp
from pymooncake.transfer.segment import BufferDesc, SegmentDescriptor
from pymooncake.transfer.transports import cma
from pymooncake.transfer.transports.cma_peers import CmaPeers
from pymooncake.transfer.transports.local import CopyJob, run_copies

pytestmark = pytest.mark.skipif(not cma.supported(),
                                reason="no process_vm_writev/readv or pidfds")


def copies(jobs: list[CopyJob]) -> list[tuple[list[int], str]]:
    """``run_copies`` outcome: one ``(indices, reason)`` per ``done`` call."""
    out: list[tuple[list[int], str]] = []
    run_copies(jobs, lambda js, reason, code: out.append(([j.index for j in js], reason)))
    return out


def test_anchor_token_name_and_table_guard_a_peer() -> None:
    buf = np.zeros(8192, dtype=np.uint8)
    base = buf.ctypes.data
    anchor = cma.CmaAnchor("me")
    anchor.publish(lambda: [(base, 8192)])
    stale: list[str] = []
    peers = CmaPeers(stale.append)
    pid = os.getpid()
    wrong = peers.peer("me", pid, anchor.addr, os.urandom(16).hex())
    assert isinstance(wrong, str) and "does not hold its anchor" in wrong
    assert isinstance(peers.peer("you", pid, anchor.addr, anchor.token.hex()), str)
    me = peers.peer("me", pid, anchor.addr, anchor.token.hex())
    assert isinstance(me, cma.CmaPeer) and me.alive()
    reason, table = me.table()
    assert reason == "" and table.covers(base, 8192) and table.covers(base + 100, 10)
    assert not table.covers(base + 1, 8192) and not table.covers(base - 1, 2)
    assert not table.covers(base + (1 << 64), 1)

    anchor.publish(lambda: [(base, 4096)])  # a range withdrawn: the next read sees it
    reason, table = me.table()
    assert reason == "" and table.covers(base, 4096) and not table.covers(base + 4096, 1)
    anchor.publish(tuple, close=True)
    anchor.publish(lambda: [(base, 8192)])  # a change after close: still nothing
    reason, table = me.table()
    assert reason == "" and table.ranges == ()

    many = cma.CmaAnchor("many")
    for i in range(3 * cma.KEEP_SNAPSHOTS):
        many.publish(lambda i=i: [(base, i + 1)])
    assert len(many._snapshots) == cma.KEEP_SNAPSHOTS  # replaced ones are let go

    # the pid now another process (reused): its anchor address holds other bytes
    ctypes.memmove(anchor.addr, os.urandom(16), 16)
    reason, _ = me.table()
    assert "no longer holds its anchor" in reason and stale == ["me"]
    peers.close()
    assert not me.alive()


@pytest.mark.parametrize("keep", [cma.KEEP_SNAPSHOTS, 1])
def test_tables_read_while_rewritten_are_never_torn(keep: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader against a writer thread swapping two tables: every table read is one of
    them whole, and none fails. With ``keep`` 1 a replaced snapshot is freed at once, so
    the reader often reads freed memory and must notice."""
    monkeypatch.setattr(cma, "KEEP_SNAPSHOTS", keep)
    a = np.zeros(1 << 16, dtype=np.uint8)
    base = a.ctypes.data
    sets = [tuple((base + i * 64, 64) for i in range(n)) for n in (1, 200)]
    anchor = cma.CmaAnchor("torn")
    anchor.publish(lambda: sets[0])
    me = CmaPeers(lambda s: None).peer("torn", os.getpid(), anchor.addr,
                                           anchor.token.hex())
    assert isinstance(me, cma.CmaPeer)
    stop = threading.Event()

    def write() -> None:  # thousands of changes a second: far more than any engine makes
        i = 0
        while not stop.is_set():
            i += 1
            anchor.publish(lambda i=i: sets[i % 2])
            time.sleep(1e-4)

    w = threading.Thread(target=write)
    w.start()
    try:
        seen: set[int] = set()
        gens: list[int] = []
        for _ in range(3000):
            reason, table = me.table()
            assert reason == "", reason
            assert table.ranges in sets, len(table.ranges)
            seen.add(len(table.ranges))
            gens.append(me._table.generation)
    finally:
        stop.set()
        w.join()
    assert seen == {1, 200}  # both were read while the other was being written
    assert gens == sorted(gens)  # the cached table only moves forwards


def test_after_a_process_error_the_rest_to_that_peer_is_not_tried(
        monkeypatch: pytest.MonkeyPatch) -> None:
    buf = np.zeros(3 * 4096, dtype=np.uint8)
    base = buf.ctypes.data
    anchor = cma.CmaAnchor("one")
    anchor.publish(lambda: [(base, 3 * 4096)])
    me = CmaPeers(lambda s: None).peer("one", os.getpid(), anchor.addr, anchor.token.hex())
    assert isinstance(me, cma.CmaPeer)
    src = np.ones(4096, dtype=np.uint8)
    jobs = [CopyJob(TransferOp.WRITE, src.ctypes.data, base + 4096 * i, 4096, 0, i, "cma", me)
            for i in range(3)]
    real = cma.copy

    def copy_once_failing(errno_: int) -> None:
        calls: list[int] = []

        def fake(*a: object) -> None:
            if a[4] == 4096:  # the jobs' copies, not the reads of the anchor
                calls.append(1)
            if len(calls) == 1 and a[4] == 4096:
                raise cma.CmaError(errno_, f"errno {errno_}")
            real(*a)  # type: ignore[arg-type]
        monkeypatch.setattr(cma, "copy", fake)

    copy_once_failing(3)  # ESRCH: the process, not the range
    out = copies(jobs)
    assert [i for i, _ in out] == [[0], [1, 2]], out
    assert "not tried after an earlier copy" in out[1][1]
    assert not buf.any()
    copy_once_failing(14)  # EFAULT: that range only
    out = copies(jobs)
    assert [i for i, _ in out] == [[1, 2], [0]], out  # done(ok) first, then the failure
    assert out[0][1] == "" and buf[4096:].all() and not buf[:4096].any()


def test_copy_reports_the_errno() -> None:
    buf = ctypes.create_string_buffer(64)
    with pytest.raises(cma.CmaError) as e:
        cma.copy(os.getpid(), TransferOp.READ, ctypes.addressof(buf), 8, 64)  # page 0
    assert e.value.errno == 14  # EFAULT
    src = ctypes.create_string_buffer(b"x" * 64)
    cma.copy(os.getpid(), TransferOp.WRITE, ctypes.addressof(src), ctypes.addressof(buf), 64)
    assert buf.raw == b"x" * 64


def test_descriptor_carries_the_anchor_and_refuses_a_bad_one() -> None:
    d = SegmentDescriptor("s", "127.0.0.1", "h", 12, 0, ("local", "cma"),
                          (BufferDesc(4096, 10),), 3, 0x7f00, "ab" * 16)
    assert SegmentDescriptor.decode(d.encode()) == d
    plain = SegmentDescriptor("s", "127.0.0.1", "h", 12, 0, ("local",), (), 1)
    assert b'"cma"' not in plain.encode() and SegmentDescriptor.decode(plain.encode()) == plain
    good = '{"anchor": 4096, "token": "' + "ab" * 16 + '"}'
    for cma_json, pid, says in (
            ("[1]", 12, "'cma' must be"),
            ('{"anchor": 4096}', 12, "'cma' must be"),
            ('{"anchor": true, "token": "' + "ab" * 16 + '"}', 12, "'cma.anchor'"),
            ('{"anchor": -5, "token": "' + "ab" * 16 + '"}', 12, "'cma.anchor'"),
            ('{"anchor": 4096.0, "token": "' + "ab" * 16 + '"}', 12, "'cma.anchor'"),
            ('{"anchor": 4096, "token": 7}', 12, "'cma.token'"),
            ('{"anchor": 4096, "token": "abcd"}', 12, "'cma.token'"),
            ('{"anchor": 4096, "token": "' + "zz" * 16 + '"}', 12, "'cma.token'"),
            (good, 2**40 + 12, "'pid'"),
            (good, 0, "'pid'")):
        raw = plain.encode().replace(b'"pid": 12', f'"pid": {pid}'.encode()).replace(
            b'"version": 1', b'"version": 1, "cma": ' + cma_json.encode())
        with pytest.raises(ValueError, match="malformed segment descriptor") as e:
            SegmentDescriptor.decode(raw)
        assert says in str(e.value), (cma_json, str(e.value))


def test_a_refusal_is_probed_again_later(monkeypatch: pytest.MonkeyPatch) -> None:
    anchor = cma.CmaAnchor("later")
    peers = CmaPeers(lambda s: None)
    token = anchor.token
    ctypes.memmove(anchor.addr, bytes(16), 16)  # not readable as its token yet
    assert isinstance(peers.peer("later", os.getpid(), anchor.addr, token.hex()), str)
    ctypes.memmove(anchor.addr, token, 16)
    assert isinstance(peers.peer("later", os.getpid(), anchor.addr, token.hex()), str)
    monkeypatch.setattr(CmaPeers, "RETRY_S", 0.0)
    assert isinstance(peers.peer("later", os.getpid(), anchor.addr, token.hex()), cma.CmaPeer)
    peers.close()
