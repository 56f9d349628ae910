"""One live owner per segment name (review finding 1), and engine threads end at close.

A second engine publishing the same name is refused at ``start`` (Mooncake's metadata
server refuses a second PUT of an ``rpc_meta`` key); the name frees up when the owner
closes, or — after a crash — when its lease of ``segment_ttl_s`` lapses.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time

import numpy as np
import pytest

from pymooncake.metadata import open_metadata
from pymooncake.transfer import (
    SegmentDescriptor,
    SegmentNameTaken,
    TransferConfig,
    TransferEngine,
    TransferOp,
    TransferRequest,
    segment_key,
)

_ns = itertools.count()


def _get(url: str, key: str):  # noqa: ANN202
    md = open_metadata(url)

    async def go():  # noqa: ANN202
        try:
            return await md.get(key)
        finally:
            await md.close()

    return asyncio.run(go())


def _engine_threads() -> list[str]:
    return [t.name for t in threading.enumerate()
            if t.name.startswith(("transfer-", "tcp-data-"))]


def test_second_engine_with_the_same_name_is_refused_and_first_keeps_its_descriptor(
        metadata_url: str) -> None:
    a = TransferEngine("own-dup", metadata_url).start()
    try:
        arr = np.arange(64, dtype=np.uint8)
        addr = a.register_memory(arr)
        with pytest.raises(SegmentNameTaken) as ei:
            TransferEngine("own-dup", metadata_url).start()
        msg = str(ei.value)
        assert ei.value.segment == "own-dup"
        assert "'own-dup'" in msg and f"pid {os.getpid()}" in msg
        assert f"tcp port {a.tcp_port}" in msg
        # The first engine's descriptor is untouched: its port and its buffer.
        desc = SegmentDescriptor.decode(_get(metadata_url, segment_key("own-dup")).value)
        assert (desc.tcp_port, desc.pid) == (a.tcp_port, os.getpid())
        assert [(b.addr, b.length) for b in desc.buffers] == [(addr, 64)]
    finally:
        a.close()
    # Closed: the name is free again and the new owner publishes its own descriptor.
    b = TransferEngine("own-dup", metadata_url).start()
    try:
        desc = SegmentDescriptor.decode(_get(metadata_url, segment_key("own-dup")).value)
        assert desc.tcp_port == b.tcp_port and desc.buffers == ()
    finally:
        b.close()
    assert _get(metadata_url, segment_key("own-dup")) is None


def test_refused_start_leaves_no_threads_and_no_lease_behind(metadata_url: str) -> None:
    a = TransferEngine("own-threads", metadata_url).start()
    try:
        before = set(_engine_threads())
        with pytest.raises(SegmentNameTaken):
            TransferEngine("own-threads", metadata_url).start()
        time.sleep(0.2)
        assert set(_engine_threads()) == before
    finally:
        a.close()


def test_crashed_owner_frees_its_name_after_the_lease_ttl(metadata_url: str,
                                                          spawn_peer) -> None:  # noqa: ANN001
    ttl_s = 1.0
    peer = spawn_peer("own-crash", size=1 << 16, segment_ttl_s=ttl_s)
    peer.kill()  # SIGKILL: no close, no revoke; the descriptor stays until the lease lapses
    t_kill = time.monotonic()
    with pytest.raises(SegmentNameTaken) as ei:
        TransferEngine("own-crash", metadata_url).start()
    assert f"pid {peer.pid}" in str(ei.value)
    # The restart works once the old lease is gone (within TTL + a keep-alive period).
    deadline = t_kill + ttl_s + ttl_s / 3 + 3.0
    while True:
        try:
            eng = TransferEngine("own-crash", metadata_url).start()
            break
        except SegmentNameTaken:
            assert time.monotonic() < deadline, "name not freed after the lease TTL"
            time.sleep(0.1)
    try:
        assert time.monotonic() - t_kill >= ttl_s / 3  # not before the lease could lapse
        desc = SegmentDescriptor.decode(_get(metadata_url, segment_key("own-crash")).value)
        assert desc.pid == os.getpid() and desc.tcp_port == eng.tcp_port
    finally:
        eng.close()


def test_live_owner_keeps_its_name_past_the_ttl_through_keep_alive() -> None:
    url = f"embedded://own-keepalive-{next(_ns)}"
    cfg = TransferConfig(segment_ttl_s=0.3)
    a = TransferEngine("own-ka", url, config=cfg).start()
    try:
        time.sleep(1.0)  # > 3 TTLs: only keep-alives keep the descriptor
        kv = _get(url, segment_key("own-ka"))
        assert kv is not None and SegmentDescriptor.decode(kv.value).tcp_port == a.tcp_port
        with pytest.raises(SegmentNameTaken):
            TransferEngine("own-ka", url, config=cfg).start()
        # Registration after the keep-alives still publishes under the same lease.
        addr = a.register_memory(np.zeros(128, np.uint8))
        kv2 = _get(url, segment_key("own-ka"))
        assert kv2.lease_id == kv.lease_id
        assert [(b.addr, b.length) for b in SegmentDescriptor.decode(kv2.value).buffers] == [
            (addr, 128)]
    finally:
        a.close()


def test_descriptor_is_published_again_after_the_metadata_server_loses_it() -> None:
    from pymooncake.metadata.http import MetadataHttpServer

    srv = MetadataHttpServer("127.0.0.1", 0).start()
    port = srv.port
    a = TransferEngine("own-md-restart", srv.url,
                       config=TransferConfig(segment_ttl_s=0.6)).start()
    try:
        addr = a.register_memory(np.zeros(32, np.uint8))
        srv.stop()  # all keys and leases gone
        srv = MetadataHttpServer("127.0.0.1", port).start()
        deadline = time.monotonic() + 5.0
        kv = None
        while kv is None and time.monotonic() < deadline:
            time.sleep(0.1)
            kv = _get(srv.url, segment_key("own-md-restart"))
        assert kv is not None, "descriptor not published again after the restart"
        desc = SegmentDescriptor.decode(kv.value)
        assert desc.tcp_port == a.tcp_port and [b.addr for b in desc.buffers] == [addr]
    finally:
        a.close()
        srv.stop()


def test_no_engine_thread_is_alive_one_second_after_close() -> None:
    url = f"embedded://own-close-{next(_ns)}"
    before = set(_engine_threads())
    a = TransferEngine("close-a", url).start()
    b = TransferEngine("close-b", url).start()
    x = np.zeros(1 << 16, np.uint8)
    y = np.arange(1 << 16, dtype=np.uint64).astype(np.uint8)
    ax, by = a.register_memory(x), b.register_memory(y)
    st = a.transfer_sync(TransferOp.READ, ax, "close-b", by, 4096)  # over tcp: paths + conns
    assert st.ok and np.array_equal(x[:4096], y[:4096])
    started = set(_engine_threads()) - before
    assert any(n.startswith("tcp-data-accept-") for n in started)
    assert any(n.startswith("transfer-path-") for n in started)
    a.close()
    b.close()
    time.sleep(1.0)
    assert set(_engine_threads()) - before == set()


def test_close_does_not_wait_for_a_window_to_an_unresponsive_peer() -> None:
    """A peer that accepts but never answers: close() fails the request and returns at
    once, not after slice_timeout_s (5 s here)."""
    import socket

    from pymooncake.transfer import StatusCode, TransferState
    from pymooncake.transfer.segment import BufferDesc, local_host_id

    url = f"embedded://own-unresponsive-{next(_ns)}"
    listener = socket.create_server(("127.0.0.1", 0))  # the kernel accepts; nobody reads
    fake = SegmentDescriptor("mute", "127.0.0.1", local_host_id(), 1,
                             listener.getsockname()[1], ("tcp",),
                             (BufferDesc(1 << 30, 1 << 20),))
    md = open_metadata(url)
    asyncio.run(md.put(segment_key("mute"), fake.encode()))
    before = set(_engine_threads())
    a = TransferEngine("asker", url, config=TransferConfig(slice_timeout_s=5.0)).start()
    try:
        x = np.zeros(4096, np.uint8)
        bid = a.allocate_batch(1)
        assert a.submit(bid, [TransferRequest(TransferOp.READ, a.register_memory(x), "mute",
                                              1 << 30, 4096)]) == 0
        time.sleep(0.3)  # the path is now blocked waiting for the reply
        assert a.status(bid, 0).state is TransferState.PENDING
        t0 = time.monotonic()
        a.close()
        took_s = time.monotonic() - t0
        assert took_s < 1.0, f"close took {took_s:.2f} s"
        st = a.status(bid, 0)
        assert (st.state, st.code, st.reason) == (TransferState.FAILED, StatusCode.INTERNAL,
                                                  "engine closed")
        time.sleep(0.5)
        assert set(_engine_threads()) - before == set()
    finally:
        a.close()
        listener.close()
