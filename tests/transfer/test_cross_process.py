"""Byte-exact transfers between two real processes over tcp and shm; bad input refused.

The peer (tests/transfer/peer.py) fills its buffer from a seeded generator; expected
bytes are regenerated here and compared by value or by a BLAKE2b digest the peer computes.
"""

from __future__ import annotations

import hashlib
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


def digest(data: np.ndarray | bytes) -> str:
    return hashlib.blake2b(memoryview(data).cast("B"), digest_size=16).hexdigest()


pytestmark = pytest.mark.integration

MiB = 1 << 20


def metric(name: str, **labels: str) -> float:
    total = 0.0
    for fam in REGISTRY.collect():
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


@pytest.fixture
def engine(metadata_url: str):  # noqa: ANN201
    eng = TransferEngine(f"test-{time.monotonic_ns()}", metadata_url, config=TransferConfig(
        checksum=True, num_paths=2, slice_timeout_s=2.0, path_retry_interval_s=0.1,
        max_retries=3)).start()
    try:
        yield eng
    finally:
        eng.close()


def test_tcp_write_and_read_are_byte_exact(engine: TransferEngine, spawn_peer) -> None:  # noqa: ANN001
    peer = spawn_peer("tcp-peer", size=8 * MiB, seed=7)
    rng = np.random.default_rng(123)
    src = rng.integers(0, 256, 8 * MiB, dtype=np.uint8)
    dst = np.zeros(8 * MiB, dtype=np.uint8)
    src_addr, dst_addr = engine.register_memory(src), engine.register_memory(dst)

    # READ the peer's initial bytes (3 requests, one of odd length) before overwriting.
    st = engine.batch_transfer_sync([
        TransferRequest(TransferOp.READ, dst_addr, peer.name, peer.addr, 5 * MiB),
        TransferRequest(TransferOp.READ, dst_addr + 5 * MiB, peer.name, peer.addr + 5 * MiB,
                        3 * MiB - 3),
        TransferRequest(TransferOp.READ, dst_addr + 8 * MiB - 3, peer.name,
                        peer.addr + 8 * MiB - 3, 3),
    ])
    assert [s.code for s in st] == [StatusCode.OK] * 3
    assert [s.transferred_bytes for s in st] == [5 * MiB, 3 * MiB - 3, 3]
    assert np.array_equal(dst, peer.initial_bytes())

    st = engine.transfer_sync(TransferOp.WRITE, src_addr, peer.name, peer.addr, 8 * MiB)
    assert st.state is TransferState.COMPLETED, st.reason
    assert peer.digest(peer.addr, 8 * MiB) == digest(src)
    # Both paths carried slices.
    assert metric("pymooncake_transfer_slices_total", path="lo#0") > 0
    assert metric("pymooncake_transfer_slices_total", path="lo#1") > 0


def test_shm_write_and_read_are_byte_exact(metadata_url: str, spawn_peer) -> None:  # noqa: ANN001
    peer = spawn_peer("shm-peer", size=MiB, seed=3, shm_size=4 * MiB)
    # No tcp at all on our side: success proves the bytes went through shared memory.
    with TransferEngine("shm-user", metadata_url,
                        config=TransferConfig(transports=("local", "shm"))) as eng:
        local = np.zeros(4 * MiB, dtype=np.uint8)
        addr = eng.register_memory(local)
        st = eng.transfer_sync(TransferOp.READ, addr, peer.name, peer.shm_addr, 4 * MiB)
        assert st.ok, st.reason
        expected = np.random.default_rng(4).integers(0, 256, 4 * MiB, dtype=np.uint8)
        assert np.array_equal(local, expected)
        local[:] = np.random.default_rng(99).integers(0, 256, 4 * MiB, dtype=np.uint8)
        st = eng.transfer_sync(TransferOp.WRITE, addr + 10, peer.name, peer.shm_addr + 20,
                               4 * MiB - 20)
        assert st.ok, st.reason
        assert peer.digest(peer.shm_addr + 20, 4 * MiB - 20) == digest(local[10:4 * MiB - 10])
        # A non-shared target of the same peer is not reachable without tcp.
        st = eng.transfer_sync(TransferOp.READ, addr, peer.name, peer.addr, 100)
        assert st.code is StatusCode.INVALID_ARGUMENT and "no common transport" in st.reason


def test_local_transport_within_one_engine(engine: TransferEngine) -> None:
    a = np.arange(MiB, dtype=np.uint8)
    b = np.zeros(MiB, dtype=np.uint8)
    aa, ba = engine.register_memory(a), engine.register_memory(b)
    st = engine.transfer_sync(TransferOp.WRITE, aa + 1, engine.segment_name, ba, MiB - 1)
    assert st.ok
    assert np.array_equal(b[: MiB - 1], a[1:]) and b[-1] == 0
    st = engine.transfer_sync(TransferOp.READ, aa, engine.segment_name, ba + MiB - 4, 8)
    assert st.code is StatusCode.INVALID_ARGUMENT


def test_out_of_range_and_unregistered_refused_on_both_ends(engine: TransferEngine,
                                                            spawn_peer) -> None:  # noqa: ANN001
    peer = spawn_peer("refuse-peer", size=2 * MiB, seed=5)
    src = np.full(MiB, 0xAB, dtype=np.uint8)
    src_addr = engine.register_memory(src)
    before = peer.digest(peer.addr, 2 * MiB)
    # Initiator side: refused at submit, status final at once (no I/O happened).
    bid = engine.allocate_batch(3)
    engine.submit(bid, [
        TransferRequest(TransferOp.WRITE, src_addr, peer.name, peer.addr + 2 * MiB - 10, 4096),
        TransferRequest(TransferOp.WRITE, src_addr + MiB - 10, peer.name, peer.addr, 4096),
        TransferRequest(TransferOp.WRITE, 0x1000, peer.name, peer.addr, 4096),
    ])
    st = [engine.status(bid, i) for i in range(3)]
    assert [s.code for s in st] == [StatusCode.INVALID_ARGUMENT] * 3
    assert "target range" in st[0].reason and "local range" in st[1].reason
    engine.free_batch(bid)
    assert peer.digest(peer.addr, 2 * MiB) == before

    # Target side: the peer withdraws its buffer while our cached descriptor still lists
    # it, so only the target's own check can refuse (and must not write into that memory).
    # The segment watch brings the new descriptor within milliseconds, so the test waits
    # for it and puts the old one back: the cache of an engine that has not yet seen it.
    engine.transfer_sync(TransferOp.READ, src_addr, peer.name, peer.addr, 16)  # cache it
    held = engine._peers[peer.name]
    assert peer.ask(f"unregister {peer.addr}") == "ok"
    deadline = time.monotonic() + 10
    while engine._peers.get(peer.name) is held:
        assert time.monotonic() < deadline, "the segment watch never brought the change"
        time.sleep(0.01)
    engine._peers[peer.name] = held
    st = engine.transfer_sync(TransferOp.WRITE, src_addr, peer.name, peer.addr, MiB)
    assert st.code is StatusCode.INVALID_ARGUMENT
    assert "refused by target" in st.reason and "outside every registered" in st.reason
    assert peer.digest(peer.addr, 2 * MiB) == before


def test_transfer_through_the_metadata_server_command() -> None:
    """`pymooncake metadata-server` in its own process; two engines find each other there."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "pymooncake", "metadata-server",
                               "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        url = f"http://127.0.0.1:{port}/metadata"
        assert url in line
        with TransferEngine("cli-a", url) as a, TransferEngine("cli-b", url) as b:
            src = np.arange(MiB, dtype=np.uint8)
            dst = np.zeros(MiB, dtype=np.uint8)
            st = a.transfer_sync(TransferOp.WRITE, a.register_memory(src), "cli-b",
                                 b.register_memory(dst), MiB)
            assert st.ok and np.array_equal(dst, src)
    finally:
        server.terminate()
        server.wait(timeout=10)
