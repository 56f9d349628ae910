"""The store with real processes on 127.0.0.1: a master (hosting the HTTP metadata
server), store servers contributing DRAM, and clients in this process; every byte moves
through the Transfer Engine."""

from __future__ import annotations

import os

import pytest

from pymooncake.store.config import ReplicateConfig
from pymooncake.store.errors import StoreError

from .procs import MiB

pytestmark = pytest.mark.integration


def pattern(seed: int, n: int) -> bytes:
    return (bytes([seed % 251]) + os.urandom(15)) * (n // 16) + bytes(n % 16)


def test_put_get_two_phase_and_distinct_replicas(cluster_factory) -> None:
    cl = cluster_factory()
    s1 = cl.store_server(8 * MiB)
    s2 = cl.store_server(8 * MiB)
    writer = cl.client()
    reader = cl.client()
    v = pattern(1, 3 * MiB + 5)
    writer.put("k", v, ReplicateConfig(replica_num=2))
    assert reader.get("k") == v
    assert reader.exist("k")
    st = reader.stats()
    assert st["dram_used_bytes"] == 2 * ((len(v) + 63) // 64 * 64)
    segs = {s1.info["segment"], s2.info["segment"]}
    assert {r.segment for r in reader.replica_list("k").replicas} == segs
    # two-phase: a key whose put is not yet ended is invisible to readers
    h = writer.put_start("half", 100)
    assert not reader.exist("half")
    with pytest.raises(StoreError) as ei:
        reader.get("half")
    assert ei.value.status == "NOT_READY"
    writer.put_end("half", h.generation)
    assert reader.exist("half")
