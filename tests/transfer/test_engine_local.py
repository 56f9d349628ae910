"""In-process checks: slicing, registration of every buffer kind, batches, wait_async."""

from __future__ import annotations

import asyncio
import itertools
import mmap
import time

import numpy as np
import pytest

from pymooncake.transfer import (
    StatusCode,
    TransferConfig,
    TransferEngine,
    TransferError,
    TransferOp,
    TransferRequest,
    TransferState,
)
from pymooncake.transfer.segment import SegmentDescriptor
from pymooncake.transfer.slicing import slice_size, split

_ns = itertools.count()
KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def pair():  # noqa: ANN201
    url = f"embedded://engine-local-{next(_ns)}"
    cfg = TransferConfig(checksum=True)
    a = TransferEngine("a", url, config=cfg).start()
    b = TransferEngine("b", url, config=cfg).start()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_slicing_spreads_over_paths_within_bounds() -> None:
    # 2.5 MiB over 2 paths, slices clamped to [64 KiB, 1 MiB]: 1 MiB, 1 MiB, 0.5 MiB.
    size = slice_size(5 * MiB // 2, 2, 64 * KiB, MiB)
    assert size == MiB
    assert split(5 * MiB // 2, size) == [(0, MiB), (MiB, MiB), (2 * MiB, MiB // 2)]
    assert slice_size(100 * KiB, 2, 64 * KiB, MiB) == 64 * KiB  # 50 KiB/path -> min
    assert slice_size(MiB, 4, 64 * KiB, MiB) == 256 * KiB
    assert split(0, 64) == []


def test_register_every_buffer_kind_and_reject_bad_ones(pair) -> None:  # noqa: ANN001
    a, _ = pair
    torch = pytest.importorskip("torch")
    ba = bytearray(b"x" * 4096)
    mm = mmap.mmap(-1, 8192)
    arr = np.zeros(1024, dtype=np.float32)
    t = torch.arange(256, dtype=torch.int64)
    addrs = [a.register_memory(x) for x in (ba, mm, arr, t)]
    assert addrs[2] == arr.ctypes.data and addrs[3] == t.data_ptr()
    assert {(r.addr, r.length) for r in a.registry.regions} == {
        (addrs[0], 4096), (addrs[1], 8192), (addrs[2], 4096), (addrs[3], 2048)}
    with pytest.raises(ValueError, match="overlaps"):
        a.register_memory(arr[10:20])
    with pytest.raises(ValueError, match="contiguous"):
        a.register_memory(np.zeros((4, 4))[:, 1])
    with pytest.raises(ValueError, match="read-only"):
        a.register_memory(b"immutable bytes")
    with pytest.raises(TypeError, match="buffer protocol"):
        a.register_memory(object())
    a.unregister_memory(arr)
    with pytest.raises(KeyError):
        a.unregister_memory(addrs[2])
    for x in (ba, t):
        a.unregister_memory(x)
    a.unregister_memory(addrs[1])
    mm.close()


def test_descriptor_published_and_withdrawn(pair) -> None:  # noqa: ANN001
    a, b = pair
    buf = np.zeros(4096, dtype=np.uint8)
    addr = b.register_memory(buf)
    assert a.get_first_buffer_address("b") == addr
    desc = SegmentDescriptor.decode(b.descriptor().encode())
    assert desc == b.descriptor() and desc.tcp_port == b.tcp_port
    with pytest.raises(ValueError, match="malformed"):
        SegmentDescriptor.decode(b'{"name": 1}')
    assert "b" in a._peers  # cached by the lookup above
    b.close()
    # a learns of the withdrawal through its watch on the segment prefix.
    deadline = time.monotonic() + 5
    while "b" in a._peers:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    st = a.transfer_sync(TransferOp.READ, a.register_memory(bytearray(16)), "b", addr, 16)
    assert st.code is StatusCode.NOT_FOUND


def test_wait_async_and_batch_misuse(pair) -> None:  # noqa: ANN001
    a, b = pair
    src = np.arange(4 * MiB, dtype=np.uint8)
    dst = np.zeros(4 * MiB, dtype=np.uint8)
    sa, da = a.register_memory(src), b.register_memory(dst)
    bid = a.allocate_batch(2)
    a.submit(bid, [TransferRequest(TransferOp.WRITE, sa, "b", da, 2 * MiB),
                   TransferRequest.from_buffer(TransferOp.WRITE, src, 2 * MiB, "b",
                                               da + 2 * MiB, 2 * MiB)])
    with pytest.raises(TransferError, match="holds 2 requests"):
        a.submit(bid, [TransferRequest(TransferOp.WRITE, sa, "b", da, 1)])

    async def main() -> list:
        return await a.wait_async(bid, timeout_s=10)

    st = asyncio.run(main())
    assert [s.state for s in st] == [TransferState.COMPLETED] * 2
    assert np.array_equal(dst, src)
    a.free_batch(bid)
    with pytest.raises(TransferError, match="unknown batch"):
        a.status(bid, 0)


def test_data_server_survives_a_malformed_client(pair) -> None:  # noqa: ANN001
    import socket

    a, b = pair
    with socket.create_connection(("127.0.0.1", b.tcp_port), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"\x00" * 64)
        assert s.recv(1) == b""  # the server hung up on the garbage
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(256, dtype=np.uint8)
    st = a.transfer_sync(TransferOp.WRITE, a.register_memory(src), "b",
                         b.register_memory(dst), 256)
    assert st.ok and np.array_equal(dst, src)


def test_paths_use_the_topology_devices(tmp_path) -> None:  # noqa: ANN001
    import json

    from pymooncake.obs.metrics import REGISTRY
    from pymooncake.transfer.topology import device_ipv4, discover

    devices = [d for loc in discover().matrix.values() for group in loc for d in group]
    dev = next((d for d in devices if d != "lo" and device_ipv4(d)), None)
    if dev is None:
        pytest.skip("no non-loopback device with an IPv4 address")
    ip = device_ipv4(dev)
    topo = tmp_path / "topo.json"
    topo.write_text(json.dumps({"cpu:0": [[dev], []]}))
    url = f"embedded://topology-{next(_ns)}"
    a = TransferEngine("ta", url, config=TransferConfig(topology_file=str(topo))).start()
    b = TransferEngine("tb", url, config=TransferConfig(host=str(ip))).start()
    try:
        src = np.arange(MiB, dtype=np.uint8)
        dst = np.zeros(MiB, dtype=np.uint8)
        st = a.transfer_sync(TransferOp.WRITE, a.register_memory(src), "tb",
                             b.register_memory(dst), MiB)
        assert st.ok and np.array_equal(dst, src)
        assert REGISTRY.get_sample_value("pymooncake_transfer_slices_total",
                                         {"transport": "tcp", "path": f"{dev}#0"}) >= 1
    finally:
        a.close()
        b.close()


def test_mixed_read_and_write_batch_of_large_requests() -> None:
    # READ payloads flowing back while WRITE payloads flow out must not deadlock a path
    # (windows far larger than the socket buffers make it certain if windows mixed ops).
    url = f"embedded://mixed-{next(_ns)}"
    cfg = TransferConfig(num_paths=1, max_slice_bytes=4 * MiB, window_bytes=64 * MiB,
                         slice_timeout_s=3.0, max_retries=0)
    a = TransferEngine("a", url, config=cfg).start()
    b = TransferEngine("b", url, config=cfg).start()
    try:
        rng = np.random.default_rng(5)
        mine = rng.integers(0, 256, 64 * MiB, dtype=np.uint8)
        theirs = rng.integers(0, 256, 64 * MiB, dtype=np.uint8)
        mine0, theirs0 = mine.copy(), theirs.copy()
        ma, ta = a.register_memory(mine), b.register_memory(theirs)
        half, n = 32 * MiB, 4 * MiB
        reqs = []
        for i in range(8):  # alternate: READ their first half, WRITE our second half
            off = i * n
            reqs.append(TransferRequest(TransferOp.READ, ma + off, "b", ta + off, n))
            reqs.append(TransferRequest(TransferOp.WRITE, ma + half + off, "b",
                                        ta + half + off, n))
        st = a.batch_transfer_sync(reqs, timeout_s=30)
        assert all(s.ok for s in st), [s.reason for s in st if not s.ok][:1]
        assert np.array_equal(mine[:half], theirs0[:half])
        assert np.array_equal(theirs[half:], mine0[half:])
    finally:
        a.close()
        b.close()


def test_endpoint_cap_below_the_number_of_paths_still_transfers_exactly() -> None:
    # 2 paths share a pool capped at 1 connection: each open evicts the other path's
    # connection (closed once its user releases it); bytes stay exact.
    url = f"embedded://cap-{next(_ns)}"
    cfg = TransferConfig(num_paths=2, max_endpoints=1, max_slice_bytes=64 * KiB,
                         checksum=True)
    a = TransferEngine("a", url, config=cfg).start()
    b = TransferEngine("b", url, config=cfg).start()
    try:
        src = np.random.default_rng(8).integers(0, 256, 8 * MiB, dtype=np.uint8)
        dst = np.zeros(8 * MiB, dtype=np.uint8)
        st = a.transfer_sync(TransferOp.WRITE, a.register_memory(src), "b",
                             b.register_memory(dst), 8 * MiB)
        assert st.ok, st.reason
        assert np.array_equal(dst, src)
        assert len(a._paths.pool) == 1
        assert a._paths.pool.num_evictions >= 1
    finally:
        a.close()
        b.close()


def test_status_of_an_index_outside_the_batch_names_batch_and_index(pair) -> None:  # noqa: ANN001
    a, b = pair
    src = a.register_memory(bytearray(b"q" * 64))
    dst_buf = bytearray(64)
    dst = b.register_memory(dst_buf)
    bid = a.allocate_batch(1)
    with pytest.raises(IndexError, match=rf"batch {bid} has no request 0: it holds 0 "):
        a.status(bid, 0)
    a.submit(bid, [TransferRequest(TransferOp.WRITE, src, "b", dst, 64)])
    a.wait(bid, timeout_s=10)
    assert a.status(bid, 0).transferred_bytes == 64 and dst_buf == bytearray(b"q" * 64)
    for i in (5, 1, -1):
        with pytest.raises(IndexError, match=rf"batch {bid} has no request {i}: it holds 1 "
                                             r"submitted requests \(indices 0\.\.0\)"):
            a.status(bid, i)


def test_submit_returns_the_number_refused_at_submit(pair) -> None:  # noqa: ANN001
    a, b = pair
    src = a.register_memory(bytearray(256))
    dst = b.register_memory(bytearray(256))
    bid = a.allocate_batch(4)
    reqs = [TransferRequest(TransferOp.WRITE, src, "b", dst, 16),           # ok
            TransferRequest(TransferOp.WRITE, src, "b", dst + 250, 16),     # target overrun
            TransferRequest(TransferOp.WRITE, src, "b", dst, 0),            # no-op, not refused
            TransferRequest(TransferOp.WRITE, src, "nosuch", dst, 16)]      # unknown segment
    assert a.submit(bid, reqs) == 2
    st = a.wait(bid, timeout_s=10)
    assert [s.code for s in st] == [StatusCode.OK, StatusCode.INVALID_ARGUMENT, StatusCode.OK,
                                    StatusCode.NOT_FOUND]
