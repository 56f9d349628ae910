"""The TransferEngine facade's calls added for Mooncake parity: ``initialize_ext``,
``get_local_topology``, ``transfer_submit_write`` + ``transfer_check_status``,
``send_probe``, ``get_notifies`` — two engines in this process over an HTTP metadata
server, with Mooncake's codes (transfer_engine_py.cpp; ../shared/MOONCAKE.md)."""

from __future__ import annotations

import json
import time

import pytest

from pymooncake.metadata.http import MetadataHttpServer
from pymooncake.transfer.compat import TransferEngine
from pymooncake.transfer.compat_util import TransferNotify, conn_string

pytestmark = pytest.mark.integration


@pytest.fixture
def pair():  # noqa: ANN201
    md = MetadataHttpServer("127.0.0.1", 0).start()
    a, b = TransferEngine(), TransferEngine()
    try:
        host, port = md.url.split("//")[1].split("/")[0].split(":")
        # address + type, as Mooncake's initialize_ext takes them
        assert a.initialize_ext("127.0.0.1:0", f"{host}:{port}", "tcp", "", "http") == 0
        assert b.initialize("127.0.0.1:1", md.url, "tcp", "") == 0
        yield a, b
    finally:
        a.close()
        b.close()
        md.stop()


def test_submit_write_check_status_probe(pair) -> None:  # noqa: ANN001
    a, b = pair
    src = a.allocate_managed_buffer(1 << 16)
    dst = b.allocate_managed_buffer(1 << 16)
    assert src and dst
    assert a.write_bytes_to_buffer(src, b"x" * 100, 100) == 0
    target = b.get_local_segment_name()
    bid = a.transfer_submit_write(target, src, dst, 100)
    assert bid > 0
    for _ in range(200):
        st = a.transfer_check_status(bid)
        if st != 0:
            break
        time.sleep(0.01)
    assert st == 1  # done
    assert b.read_bytes_from_buffer(dst, 100) == b"x" * 100
    # an unknown peer: the documented failure sentinel 0, no exception
    assert a.transfer_submit_write("unreachable_peer:9", 0, 0, 16) == 0
    assert a.batch_transfer_async_write("unreachable_peer:9", [0], [0], [16]) == 0
    assert a.send_probe(target) == 0
    assert a.send_probe("unreachable_peer:9") != 0
    assert TransferEngine().send_probe(target) == -1  # not initialised
    assert a.get_notifies() == []


def test_local_topology_and_conn_strings() -> None:
    topo = json.loads(TransferEngine.get_local_topology())
    assert topo and all(k.startswith("cpu:") for k in topo)
    assert all(isinstance(v, list) and len(v) == 2 for v in topo.values())
    only = json.loads(TransferEngine.get_local_topology("no-such-nic"))
    assert all(v == [[], []] for v in only.values())
    assert conn_string("h:2379", "etcd") == "etcd://h:2379"
    assert conn_string("h:8080", "http") == "http://h:8080/metadata"
    assert conn_string("P2PHANDSHAKE", "p2p") == "P2PHANDSHAKE"
    assert conn_string("http://h:1/metadata", "etcd") == "http://h:1/metadata"
    n = TransferNotify("peer", "msg")
    assert (n.name, n.msg) == ("peer", "msg") and TransferEngine.TransferNotify is TransferNotify
