"""One Transfer Engine per process: a ``StoreClient`` given the worker's engine uses it
(its segment is the engine's), moves bytes straight between registered memory and the
replicas (``put_from`` / ``get_into``), and leaves the engine running when it closes."""

from __future__ import annotations

import numpy as np
import pytest

from pymooncake.store.client import StoreClient
from pymooncake.store.config import ReplicateConfig
from pymooncake.store.errors import ErrorCode, StoreError
from pymooncake.transfer import TransferConfig, TransferEngine

from .procs import MiB
from .test_store_processes import pattern

pytestmark = pytest.mark.integration


def test_store_client_uses_the_given_transfer_engine(cluster_factory) -> None:
    cl = cluster_factory()
    cl.store_server(8 * MiB)
    te = TransferEngine("worker-te", cl.metadata_url,
                        config=TransferConfig(transports=("local", "shm", "tcp"))).start()
    try:
        with pytest.raises(ValueError):
            StoreClient(cl.master_addr, cl.metadata_url, transfer_engine=te, name="other")
        c = StoreClient(cl.master_addr, cl.metadata_url, transfer_engine=te,
                        global_segment_size=4 * MiB, local_buffer_size=MiB,
                        heartbeat_interval_s=0.2).start()
        assert c.segment_name == "worker-te" and c._dp is not None and c._dp.engine is te
        reader = cl.client()
        v = pattern(5, 300_000)
        # bytes puts, into our own segment and into the store server's
        c.put("own", v, ReplicateConfig(preferred_segment=c.segment_name))
        c.put("far", v)
        assert reader.get("own") == v and reader.get("far") == v
        assert {r.segment for r in reader.replica_list("own").replicas} == {"worker-te"}
        # zero copy: put_from a registered buffer, get_into another one
        src = np.frombuffer(pattern(6, 2 * MiB), dtype=np.uint8).copy()
        dst = np.zeros(2 * MiB, dtype=np.uint8)
        a_src, a_dst = c.register_buffer(src), c.register_buffer(dst)
        c.put_from("zc-own", a_src, MiB, ReplicateConfig(preferred_segment=c.segment_name))
        c.put_from("zc-far", a_src + MiB, MiB)
        assert c.get_into("zc-own", a_dst + MiB, MiB) == MiB
        assert c.get_into("zc-far", a_dst, MiB) == MiB
        assert bytes(dst[:MiB]) == bytes(src[MiB:]) and bytes(dst[MiB:]) == bytes(src[:MiB])
        assert reader.get("zc-own") == bytes(src[:MiB])
        res = c.batch_get_into(["zc-far", "missing", "zc-own"], [a_dst, a_dst, a_dst + MiB],
                               [MiB, MiB, MiB // 2])
        assert res[0] == MiB and res[1].status == "NOT_FOUND"
        assert res[2].status == "INVALID_ARGUMENT"  # buffer smaller than the object
        c.close()
        # the engine is still the caller's and still works; our buffers were handed back
        buf = np.zeros(4096, dtype=np.uint8)
        assert te.register_memory(buf) > 0
    finally:
        te.close()


def test_a_client_not_started_or_closed_refuses_every_call_and_leaves_nothing(
        cluster_factory) -> None:
    """A put on a StoreClient that was never started (or was closed) is one clear error
    before the master sees it: no bare AssertionError, no key left in PROCESSING that would
    refuse everyone else's put of it."""
    cl = cluster_factory()
    cl.store_server(8 * MiB)
    idle = StoreClient(cl.master_addr, cl.metadata_url, global_segment_size=MiB)
    for call in (lambda: idle.put("k", b"v" * 100), lambda: idle.get("k"),
                 lambda: idle.remove("k")):
        with pytest.raises(StoreError, match="not started") as e:
            call()
        assert e.value.code is ErrorCode.INVALID_PARAMS and not e.value.retryable
    other = cl.client()
    other.put("k", b"w" * 100)              # not held up by a half-made put of "k"
    assert other.get("k") == b"w" * 100
    c = StoreClient(cl.master_addr, cl.metadata_url, global_segment_size=MiB).start()
    c.close()
    with pytest.raises(StoreError, match="was closed"):
        c.put("k2", b"x")
    assert not other.exist("k2")
