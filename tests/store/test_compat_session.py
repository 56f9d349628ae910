"""Mooncake's put/get session calls, ``put_from_with_metadata``, segment management and
``bind_to_numa_node`` on the compat store, against a real pymooncake master and two
clients (so ranges cross the Transfer Engine). Expected codes are Mooncake's
``real_client.cpp`` (commit 3b5a594): -600 INVALID_PARAMS, -704 OBJECT_NOT_FOUND,
-705 OBJECT_ALREADY_EXISTS, -707 LEASE_EXPIRED; expected bytes are the source buffers'."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from pymooncake.store.compat import (
    MooncakeDistributedStore,
    MooncakeDistributedStoreAsync,
    ReplicateConfig,
    bind_to_numa_node,
)
from tests.store.procs import Cluster

pytestmark = pytest.mark.integration

MB = 1 << 20
INVALID_PARAMS, NOT_FOUND, EXISTS, LEASE_EXPIRED = -600, -704, -705, -707
PAGE, LAYERS = 1024, 4


def _store(cl, cls=MooncakeDistributedStore):
    s = cls()
    assert s.setup("localhost", cl.metadata_url, 16 * MB, 16 * MB, "tcp", "",
                   cl.master_addr) == 0
    return s


@pytest.fixture(scope="module")
def two():
    """Two clients of one master, shared by the tests (each uses its own keys)."""
    cl = Cluster("--default-kv-lease-ttl", "20000")
    try:
        a, b = _store(cl), _store(cl, MooncakeDistributedStoreAsync)
        yield a, b
        a.close()
        b.close()
    finally:
        cl.close()


_KEEP: list[np.ndarray] = []  # registered buffers stay alive (and registered) all module


def _reg(s, n: int, fill: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    buf = np.zeros(n, dtype=np.uint8) if fill is None else fill.copy()
    _KEEP.append(buf)
    ptr = int(buf.ctypes.data)
    assert s.register_buffer(ptr, n) == 0
    return buf, ptr


def test_layerwise_put_then_get_sessions(two) -> None:
    """Mooncake's session_ranges e2e flow: each key's object written layer by layer from
    one client, read layer by layer by another; the bytes land where the ranges say."""
    a, b = two
    keys = ["s0", "s1", "s2"]
    obj = PAGE * LAYERS
    src_vals = np.random.default_rng(7).integers(0, 256, obj * len(keys), dtype=np.uint8)
    src, sp = _reg(a, src_vals.size, src_vals)
    dst, dp = _reg(b, src.size)
    assert a.batch_put_session_start(keys, [obj] * len(keys)) == [0, 0, 0]
    assert [a.is_exist(k) for k in keys] == [0, 0, 0]  # reserved, not readable yet
    for layer in range(LAYERS):
        rcs = a.batch_put_from_multi_buffer_ranges(
            keys, [[sp + i * obj + layer * PAGE] for i in range(len(keys))],
            [[PAGE]] * len(keys), [[layer * PAGE]] * len(keys))
        assert rcs == [PAGE] * len(keys)
    assert a.batch_put_session_end(keys) == [0, 0, 0]
    assert [b.get(k) for k in keys] == [src_vals[i * obj:(i + 1) * obj].tobytes()
                                        for i in range(len(keys))]

    assert b.batch_get_session_start(keys) == [0, 0, 0]
    for layer in reversed(range(LAYERS)):
        rcs = b.batch_get_into_multi_buffer_ranges(
            keys, [[dp + i * obj + layer * PAGE] for i in range(len(keys))],
            [[PAGE]] * len(keys), [[layer * PAGE]] * len(keys))
        assert rcs == [PAGE] * len(keys)
    assert dst.tobytes() == src_vals.tobytes()
    # several ranges of one key: the sum of their sizes; out of order and overlapping
    dst[:] = 0
    assert b.batch_get_into_multi_buffer_ranges(
        ["s1"], [[dp, dp + 100]], [[10, 300]], [[obj - 10, 5]]) == [310]
    assert dst[:10].tobytes() == src_vals[2 * obj - 10:2 * obj].tobytes()
    assert dst[100:400].tobytes() == src_vals[obj + 5:obj + 305].tobytes()
    assert b.batch_get_session_end(keys) == 0
    assert b.batch_get_into_multi_buffer_ranges(["s0"], [[dp]], [[8]], [[0]]) == [
        INVALID_PARAMS]  # the session ended


def test_put_ranges_to_a_remote_replica(two) -> None:
    """Ranges written by one client into a replica on the other's segment (Transfer
    Engine writes), read back through a get session on the writer."""
    a, b = two
    cfg = ReplicateConfig()
    cfg.preferred_segment = a.get_hostname()
    vals = np.random.default_rng(3).integers(0, 256, 3000, dtype=np.uint8)
    _, sp = _reg(b, vals.size, vals)
    assert b.batch_put_session_start(["remote"], [3000], cfg) == [0]
    assert b.batch_put_from_multi_buffer_ranges(
        ["remote"], [[sp + 1000, sp]], [[2000, 1000]], [[1000, 0]]) == [3000]
    assert b.batch_put_session_end(["remote"]) == [0]
    (rep,) = a.get_replica_desc("remote")
    assert rep.get_memory_descriptor().buffer_descriptor.transport_endpoint == \
        a.get_hostname()
    dst, dp = _reg(b, 3000)
    assert b.batch_get_session_start(["remote"]) == [0]
    assert b.batch_get_into_multi_buffer_ranges(["remote"], [[dp]], [[3000]], [[0]]) == [
        3000]
    assert dst.tobytes() == vals.tobytes()
    assert b.batch_get_session_end(["remote"]) == 0


def test_session_codes(two) -> None:
    a, b = two
    src, sp = _reg(a, 4096, np.arange(4096, dtype=np.uint64).astype(np.uint8))
    assert a.put("old", b"x" * 10) == 0
    assert a.batch_put_session_start(["old", "p"], [100, 2048]) == [EXISTS, 0]
    assert a.batch_put_session_start(["p"], [2048]) == [INVALID_PARAMS]  # already open
    assert a.batch_put_session_start(["q", "r"], [1]) == [INVALID_PARAMS] * 2
    assert a.batch_put_session_start([], []) == []
    # ranges: no session; past the end; lengths that disagree; unregistered memory
    assert a.batch_put_from_multi_buffer_ranges(
        ["nosession", "p", "p", "p", "p"],
        [[sp], [sp], [sp, sp], [sp], [12345]], [[8], [1024], [8], [8], [8]],
        [[0], [1025], [0, 8], [2040], [0]]) == [INVALID_PARAMS, INVALID_PARAMS,
                                                INVALID_PARAMS, 8, INVALID_PARAMS]
    assert a.batch_put_from_multi_buffer_ranges(["p", "p"], [[sp]], [[8]], [[0]]) == [
        INVALID_PARAMS] * 2  # outer lists of different lengths
    assert b.get("p") == b""  # reserved, unreadable
    assert a.batch_put_from_multi_buffer_ranges(["p"], [[]], [[]], [[]]) == [-702]  # no range
    # only [2040, 2048) was written: the rest reads back as zeros
    assert a.batch_put_session_end(["p", "nosession"]) == [0, INVALID_PARAMS]
    assert b.get("p") == bytes(2040) + src[:8].tobytes()
    assert a.batch_put_session_end(["p"]) == [INVALID_PARAMS]  # already ended

    # revoke: frees the reservation; the key can be put again
    assert a.batch_put_session_start(["rv"], [512]) == [0]
    assert a.batch_put_from_multi_buffer_ranges(["rv"], [[sp]], [[512]], [[0]]) == [512]
    assert a.batch_put_session_revoke(["rv", "none"]) == [0, INVALID_PARAMS]
    assert a.is_exist("rv") == 0 and b.get("rv") == b""
    assert a.batch_put_from_multi_buffer_ranges(["rv"], [[sp]], [[8]], [[0]]) == [
        INVALID_PARAMS]
    assert a.put("rv", b"again") == 0 and b.get("rv") == b"again"

    # get sessions: missing key -704; ranges past the object -600; no session -600
    _, dp = _reg(b, 4096)
    assert b.batch_get_session_start(["old", "missing"]) == [0, NOT_FOUND]
    assert b.batch_get_into_multi_buffer_ranges(
        ["old", "old", "missing", "old"], [[dp], [dp], [dp], [dp, dp]], [[10], [11], [1], [1]],
        [[0], [0], [0], [0]]) == [10, INVALID_PARAMS, INVALID_PARAMS, INVALID_PARAMS]
    assert b.batch_get_into_multi_buffer_ranges(["old"], [[dp]], [[0]], [[10]]) == [0]
    assert b.batch_get_session_end(["old", "never-started"]) == 0


def test_types_and_before_setup(two) -> None:
    a, _ = two
    for call in (lambda: a.batch_put_session_start("abc", [1]),
                 lambda: a.batch_put_session_start(["k"], [-1]),
                 lambda: a.batch_put_session_start(["k"], [1], {"replica_num": 1}),
                 lambda: a.batch_get_session_start([1]),
                 lambda: a.batch_get_into_multi_buffer_ranges(["k"], [[1.5]], [[1]], [[0]]),
                 lambda: a.batch_put_from_multi_buffer_ranges(["k"], [1], [[1]], [[0]]),
                 lambda: a.batch_get_session_end(None),
                 lambda: a.put_from_with_metadata("k", "ptr", 0, 1, 1),
                 lambda: a.mount_segment("/dev/shm/x", -1),
                 lambda: bind_to_numa_node("0")):
        with pytest.raises(TypeError):
            call()
    fresh = MooncakeDistributedStore()  # pybind wrapper's answers before setup
    assert fresh.batch_put_session_start(["k"], [1]) == []
    assert fresh.batch_put_from_multi_buffer_ranges(["k"], [[1]], [[1]], [[0]]) == []
    assert fresh.batch_put_session_end(["k"]) == []
    assert fresh.batch_put_session_revoke(["k"]) == []
    assert fresh.batch_get_session_start(["k"]) == []
    assert fresh.batch_get_into_multi_buffer_ranges(["k"], [[1]], [[1]], [[0]]) == []
    assert fresh.batch_get_session_end(["k"]) == -1
    assert fresh.put_from_with_metadata("k", 1, 1, 1, 1) == INVALID_PARAMS


def test_lease_expiry_ends_get_session(cluster_factory) -> None:
    cl = cluster_factory("--default-kv-lease-ttl", "300")
    s = _store(cl)
    try:
        assert s.put("k", b"abcdef") == 0
        _, dp = _reg(s, 64)
        assert s.batch_get_session_start(["k"]) == [0]
        time.sleep(0.6)
        assert s.batch_get_into_multi_buffer_ranges(["k"], [[dp]], [[3]], [[0]]) == [
            LEASE_EXPIRED]
        assert s.batch_get_into_multi_buffer_ranges(["k"], [[dp]], [[3]], [[0]]) == [
            INVALID_PARAMS]  # the expired session was dropped
    finally:
        s.close()


def test_put_from_with_metadata_and_async(two) -> None:
    import asyncio

    a, b = two
    meta, mp = _reg(a, 16, np.full(16, 7, dtype=np.uint8))
    data, dp = _reg(a, 100, np.arange(100, dtype=np.uint8))
    assert a.put_from_with_metadata("m", dp, mp, 100, 16) == 0
    assert b.get("m") == bytes([7] * 16) + bytes(range(100))
    assert a.put_from_with_metadata("m", dp, mp, 10, 1) == 0  # exists: kept, as a put
    assert b.get_size("m") == 116
    assert a.put_from_with_metadata("empty", dp, mp, 0, 16) == 0 and a.is_exist("empty") == 0
    cfg = ReplicateConfig()
    cfg.prefer_alloc_in_same_node = True
    assert a.put_from_with_metadata("n", dp, mp, 100, 16, cfg) == -1
    assert a.put_from_with_metadata("n", 4096, mp, 100, 16) == INVALID_PARAMS  # unregistered

    async def run() -> list:
        return [await b.async_batch_put_session_start(["as"], [4]),
                await b.async_batch_put_session_end(["as"])]
    assert asyncio.run(run()) == [[0], [0]] and a.get("as") == bytes(4)


def test_segments_offload_count_numa(two) -> None:
    from pymooncake.store import compat as ms

    # pybind's export_values(): enum members at module level, TaskStatus's PROCESSING
    # shadowing ReplicaStatus's (as mooncake.store 0.3.13 shows)
    assert (ms.PROCESSING, ms.COMPLETE, ms.KVCACHE, ms.REPLICA_MOVE) == (
        ms.TaskStatus.PROCESSING, ms.ReplicaStatus.COMPLETE, ms.ObjectDataType.KVCACHE,
        ms.TaskType.REPLICA_MOVE)
    a, _ = two
    assert a.mount_segment("/dev/shm/seg", 1 * MB) == {"ret": -1, "segment_ids": []}
    assert a.allocate_and_mount_segment(1 * MB) == {"ret": -1, "segment_ids": [],
                                                    "allocated_size": 0}
    assert a.unmount_segment(["x"]) == -1 and a.unmount_and_free_segment(["x"], 1) == -1
    assert a.unmount_local_disk_segment() == -1
    assert a.get_offload_rpc_read_count() == 0
    before = os.sched_getaffinity(0)
    try:
        assert bind_to_numa_node(0) is None
        node0 = "/sys/devices/system/node/node0/cpulist"
        if os.path.exists(node0):
            with open(node0) as f:
                spec = f.read().strip()
            want = set()
            for part in spec.split(","):
                lo, _, hi = part.partition("-")
                want.update(range(int(lo), int(hi or lo) + 1))
            assert os.sched_getaffinity(0) == want
        assert bind_to_numa_node(4096) is None  # an unknown node: a warning only
    finally:
        os.sched_setaffinity(0, before)
