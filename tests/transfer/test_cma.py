"""The ``cma`` transport: one kernel copy into a same-host peer's ordinary memory.

Real peer processes (tests/transfer/peer.py) that offer only ``local`` and ``cma``, so a
request that did not go over ``cma`` fails; expected bytes are regenerated here from the
peer's seed or compared by the BLAKE2b digest the peer computes. The guards of
``transports/cma.py`` (anchor token, generation) are checked across processes and, for
the cases a live peer cannot be made to show, on this process's own anchor.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import os
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
from pymooncake.transfer.segment import BufferDesc, SegmentDescriptor
from pymooncake.transfer.transports import cma
from pymooncake.transfer.transports.local import CopyJob, run_copies

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not cma.supported(), reason="no process_vm_writev")]

MiB = 1 << 20
CMA_ONLY = "local,cma"


def digest(data: np.ndarray | bytes) -> str:
    return hashlib.blake2b(memoryview(data).cast("B"), digest_size=16).hexdigest()


def cma_bytes() -> float:
    total = 0.0
    for fam in REGISTRY.collect():
        for s in fam.samples:
            if s.name == "pymooncake_transfer_bytes_total" and s.labels.get("transport") == "cma":
                total += s.value
    return total


@pytest.fixture
def user(metadata_url: str):  # noqa: ANN201
    eng = TransferEngine(f"cma-user-{time.monotonic_ns()}", metadata_url,
                         config=TransferConfig(transports=("local", "cma"))).start()
    try:
        yield eng
    finally:
        eng.close()


def test_cma_write_and_read_are_byte_exact(user: TransferEngine, spawn_peer) -> None:  # noqa: ANN001
    peer = spawn_peer("cma-peer", size=8 * MiB, seed=5, transports=CMA_ONLY)
    want = peer.initial_bytes()
    local = np.zeros(8 * MiB, dtype=np.uint8)
    addr = user.register_memory(local)
    before = cma_bytes()

    # a read of the whole buffer in uneven requests, through the copy thread
    cuts = [0, 1, 4096 + 7, 3 * MiB + 5, 8 * MiB]
    reqs = [TransferRequest(TransferOp.READ, addr + a, peer.name, peer.addr + a, b - a)
            for a, b in itertools.pairwise(cuts)]
    bid = user.allocate_batch(len(reqs))
    assert user.submit(bid, reqs) == 0
    assert all(s.state is TransferState.COMPLETED for s in user.wait(bid, timeout_s=30))
    user.free_batch(bid)
    assert np.array_equal(local, want)

    # a write at an odd offset, done in the calling thread
    src = np.random.default_rng(9).integers(0, 256, 3 * MiB, dtype=np.uint8)
    local[:3 * MiB] = src
    st = user.transfer_sync(TransferOp.WRITE, addr, peer.name, peer.addr + 333, 3 * MiB)
    assert st.state is TransferState.COMPLETED, st
    assert peer.digest(peer.addr + 333, 3 * MiB) == digest(src)
    assert peer.digest(peer.addr, 333) == digest(want[:333])  # nothing before it touched
    assert cma_bytes() - before == 8 * MiB + 3 * MiB


def test_a_peer_without_cma_is_reached_over_tcp(metadata_url: str, spawn_peer) -> None:  # noqa: ANN001
    peer = spawn_peer("no-cma-peer", size=MiB, seed=6)  # local,shm,tcp: no anchor
    with TransferEngine("cma-tcp-user", metadata_url,
                        config=TransferConfig(transports=("local", "cma", "tcp"))) as eng:
        local = np.zeros(MiB, dtype=np.uint8)
        addr = eng.register_memory(local)
        before = cma_bytes()
        st = eng.transfer_sync(TransferOp.READ, addr, peer.name, peer.addr, MiB)
        assert st.state is TransferState.COMPLETED, st
        assert np.array_equal(local, peer.initial_bytes())
        assert cma_bytes() == before


def test_memory_withdrawn_after_the_descriptor_was_read_is_never_written(
        user: TransferEngine, spawn_peer) -> None:  # noqa: ANN001
    peer = spawn_peer("cma-unreg", size=2 * MiB, seed=7, transports=CMA_ONLY)
    local = np.random.default_rng(10).integers(0, 256, MiB, dtype=np.uint8)
    addr = user.register_memory(local)
    st = user.transfer_sync(TransferOp.WRITE, addr, peer.name, peer.addr, MiB)
    assert st.state is TransferState.COMPLETED, st
    # the peer as routed with the descriptor read before the withdrawal
    desc = user._resolve(peer.name)
    assert desc is not None and desc.cma_anchor
    held = user._router.cma.peer(desc.name, desc.pid, desc.cma_anchor, desc.cma_token,
                                 desc.cma_generation)
    assert held is not None and held.pid == peer.pid

    assert peer.ask(f"unregister {peer.addr}") == "ok"  # the memory stays allocated there
    local[:] = 0xAB
    outcome: list[tuple[int, str]] = []
    run_copies([CopyJob(TransferOp.WRITE, addr, peer.addr, MiB, 0, 0, "cma", held)],
               lambda jobs, reason: outcome.extend((j.index, reason) for j in jobs))
    assert len(outcome) == 1 and "withdrew memory" in outcome[0][1], outcome
    # and through the engine: refused, stale descriptor or not
    st = user.transfer_sync(TransferOp.WRITE, addr, peer.name, peer.addr, MiB)
    assert st.state is TransferState.FAILED, st
    first = np.random.default_rng(10).integers(0, 256, MiB, dtype=np.uint8)
    assert peer.digest(peer.addr, MiB) == digest(first)  # still the first write's bytes


def test_a_killed_peer_fails_the_request_at_once(user: TransferEngine, spawn_peer) -> None:  # noqa: ANN001
    peer = spawn_peer("cma-dead", size=MiB, seed=8, transports=CMA_ONLY)
    local = np.zeros(MiB, dtype=np.uint8)
    addr = user.register_memory(local)
    st = user.transfer_sync(TransferOp.READ, addr, peer.name, peer.addr, MiB)
    assert st.state is TransferState.COMPLETED, st
    peer.kill()
    t0 = time.monotonic()
    bid = user.allocate_batch(1)
    user.submit(bid, [TransferRequest(TransferOp.WRITE, addr, peer.name, peer.addr, MiB)])
    (st,) = user.wait(bid, timeout_s=10)
    assert st.state is TransferState.FAILED and st.code is StatusCode.INTERNAL, st
    assert "No such process" in st.reason or "no longer" in st.reason, st.reason
    assert time.monotonic() - t0 < 5


# ------------------------------------------------------------- this process's own anchor
def test_anchor_token_and_generation_guard_a_peer() -> None:
    anchor = cma.CmaAnchor()
    stale: list[str] = []
    peers = cma.CmaPeers(stale.append)
    pid = os.getpid()
    assert peers.peer("me", pid, anchor.addr, os.urandom(16).hex(), 0) is None  # wrong token
    assert peers.peer("me", pid, anchor.addr, "not hex", 0) is None
    me = peers.peer("me", pid, anchor.addr, anchor.token.hex(), 0)
    assert me is not None and me.check() == "" and stale == []

    anchor.bump()  # a range withdrawn since the descriptor was read
    reason = me.check()
    assert "generation 0 -> 1" in reason and stale == ["me"]
    # probing with the old generation: not used, and the descriptor is dropped again
    assert cma.CmaPeers(stale.append).peer("me", pid, anchor.addr, anchor.token.hex(), 0) is None
    assert stale == ["me", "me"]
    assert cma.CmaPeers(stale.append).peer("me", pid, anchor.addr, anchor.token.hex(), 1)


def test_copy_reports_the_errno() -> None:
    buf = ctypes.create_string_buffer(64)
    with pytest.raises(cma.CmaError) as e:
        cma.copy(os.getpid(), TransferOp.READ, ctypes.addressof(buf), 8, 64)  # page 0
    assert e.value.errno == 14  # EFAULT
    src = ctypes.create_string_buffer(b"x" * 64)
    cma.copy(os.getpid(), TransferOp.WRITE, ctypes.addressof(src), ctypes.addressof(buf), 64)
    assert buf.raw == b"x" * 64


def test_descriptor_carries_the_anchor() -> None:
    d = SegmentDescriptor("s", "127.0.0.1", "h", 12, 0, ("local", "cma"),
                          (BufferDesc(4096, 10),), 3, 0x7f00, "ab" * 16, 2)
    back = SegmentDescriptor.decode(d.encode())
    assert back == d
    plain = SegmentDescriptor("s", "127.0.0.1", "h", 12, 0, ("local",), (), 1)
    assert b'"cma"' not in plain.encode() and SegmentDescriptor.decode(plain.encode()) == plain
    bad = plain.encode().replace(b'"version": 1', b'"version": 1, "cma": {"anchor": "x"}')
    with pytest.raises(ValueError, match="malformed segment descriptor"):
        SegmentDescriptor.decode(bad)
    with pytest.raises(ValueError, match="malformed segment descriptor"):
        SegmentDescriptor.decode(plain.encode().replace(b'"version": 1',
                                                        b'"version": 1, "cma": [1]'))
