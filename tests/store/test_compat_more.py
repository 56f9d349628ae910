"""The compat store methods added for Mooncake parity, against a real pymooncake master:
``*_with_tp`` tensor forms, the zero-copy tensor forms, safetensors save/load, copy/move
tasks, ``MooncakeDistributedStoreAsync``, ``BufferPool``, ``setup_dummy`` with a real
client, and ``metadata_server="P2PHANDSHAKE"``. Expected values are Mooncake's
(store_py.cpp; ../shared/MOONCAKE.md)."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from pymooncake.store.compat import (
    MooncakeDistributedStore,
    MooncakeDistributedStoreAsync,
    QueryTaskResponse,
    ReplicateConfig,
    TaskStatus,
    TaskType,
)
from pymooncake.store.compat._buffer_pool import BufferPool
from tests.store.procs import ROOT, free_port

pytestmark = pytest.mark.integration

MB = 1 << 20
INVALID_PARAMS, OBJECT_NOT_FOUND, TASK_NOT_FOUND = -600, -704, -1400


@pytest.fixture
def env(cluster_factory):
    cl = cluster_factory("--default-kv-lease-ttl", "500")
    stores: list[MooncakeDistributedStore] = []

    def make(host: str = "localhost", segment: int = 16 * MB, local: int = 16 * MB,
             cls: type = MooncakeDistributedStore) -> MooncakeDistributedStore:
        s = cls()
        assert s.setup(host, cl.metadata_url, segment, local, "tcp", "", cl.master_addr) == 0
        stores.append(s)
        return s

    yield cl, make
    for s in stores:
        s.close()


def _registered(store: MooncakeDistributedStore, n: int) -> tuple[np.ndarray, int]:
    buf = np.zeros(n, dtype=np.uint8)
    ptr = int(buf.ctypes.data)
    assert store.register_buffer(ptr, n) == 0
    return buf, ptr


def test_tp_forms(env) -> None:
    torch = pytest.importorskip("torch")
    _, make = env
    s = make()
    t = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    assert s.put_tensor_with_tp("w", t, tp_rank=3, tp_size=4, split_dim=0) == 0
    assert [s.is_exist(f"w_tp_{r}") for r in range(4)] == [1, 1, 1, 1]
    assert s.is_exist("w") == 0  # only the shards are stored
    for r, chunk in enumerate(t.chunk(4, 0)):
        assert torch.equal(s.get_tensor_with_tp("w", tp_rank=r, tp_size=4), chunk)
    assert [x.shape for x in s.batch_get_tensor_with_tp(["w"], tp_rank=1, tp_size=4)] == [
        (2, 6)]
    # tp_size 1 is the plain call on the key itself
    assert s.put_tensor_with_tp("plain", t) == 0 and torch.equal(s.get_tensor("plain"), t)
    assert s.put_tensor_with_tp("bad", t, tp_size=2, split_dim=5) == INVALID_PARAMS
    assert s.put_tensor_with_tp("bad", t, tp_size=3, split_dim=0) == INVALID_PARAMS  # 8 % 3
    assert s.batch_pub_tensor_with_tp(["p1", "p2"], [t, t], ReplicateConfig(), tp_size=2,
                                      split_dim=1) == [0, 0]
    assert torch.equal(s.get_tensor_with_tp("p2", tp_rank=1, tp_size=2), t.chunk(2, 1)[1])
    # zero-copy: the full object in registered memory, split by the store
    buf, ptr = _registered(s, 4 * MB)
    got = s.get_tensor_into("plain", ptr, 4 * MB)
    assert torch.equal(got, t)
    full = 304 + t.numel() * 4
    assert s.put_tensor_with_tp_from("z", ptr, full, tp_rank=0, tp_size=2, split_dim=1) == 0
    assert s.put_tensor_with_tp_from("z2", ptr, full - 1, tp_size=2) == INVALID_PARAMS
    shard = s.get_tensor_with_tp_into("z", ptr + 2 * MB, 1 * MB, tp_rank=1, tp_size=2)
    assert torch.equal(shard, t.chunk(2, 1)[1])
    assert s.batch_get_tensor_with_tp_into(["z"], [ptr + 3 * MB], [MB], tp_rank=0,
                                           tp_size=2)[0].shape == (8, 3)


def test_tensor_from_and_into(env) -> None:
    _, make = env
    s = make()
    arr = np.arange(100, dtype=np.float32)
    assert s.put_tensor("t", arr) == 0
    buf, ptr = _registered(s, 1 * MB)
    view = s.get_tensor_into("t", ptr, 1 * MB)
    assert np.array_equal(view, arr)
    view[:] = 42.0  # a view of the caller's buffer: edits land there
    n = 304 + arr.nbytes
    assert s.upsert_tensor_from("t", ptr, n) == 0
    assert np.all(np.asarray(s.get_tensor("t")) == 42.0)
    assert s.put_tensor_from("u", ptr, n + 8) == INVALID_PARAMS  # size != the object's
    assert s.put_tensor_from("u", ptr + 1, 400) == INVALID_PARAMS  # no tensor there
    unregistered = np.zeros(n, dtype=np.uint8)
    assert s.put_tensor_from("u", int(unregistered.ctypes.data), n) == INVALID_PARAMS
    assert s.batch_put_tensor_from(["u", "v"], [ptr, ptr], [n, 3]) == [0, INVALID_PARAMS]
    assert s.get_tensor_into("missing", ptr, MB) is None
    assert s.get_tensor("missing") is None


def test_safetensors_save_load(env, tmp_path) -> None:
    _, make = env
    s = make()
    arr = np.arange(12, dtype=np.int32).reshape(3, 4)
    assert s.put_tensor("k", arr) == 0
    path = str(tmp_path / "k.safetensors")
    assert s.save_tensor_to_safetensor("k", path) == 0
    assert s.save_tensor_to_safetensor("missing", path + "x") == -1100  # FILE_NOT_FOUND
    got = s.load_tensor_from_safetensor("k2", path)  # not a name in the file: the first
    assert np.array_equal(np.asarray(got), arr)
    assert np.array_equal(np.asarray(s.get_tensor("k2")), arr)
    assert s.load_tensor_from_safetensor(None, str(tmp_path / "nope")) is None


def _replicas(s: MooncakeDistributedStore, key: str) -> list[str]:
    return sorted(d.get_memory_descriptor().buffer_descriptor.transport_endpoint
                  for d in s.get_replica_desc(key))


def _done(s: MooncakeDistributedStore, task_id) -> QueryTaskResponse:
    for _ in range(200):
        resp, err = s.query_task(task_id)
        assert err == 0
        if resp.status in (TaskStatus.SUCCESS, TaskStatus.FAILED):
            return resp
        time.sleep(0.05)
    raise AssertionError("task did not finish")


def test_copy_move_tasks(env) -> None:
    _, make = env
    ports = [free_port() for _ in range(3)]
    segs = [f"localhost:{p}" for p in ports]
    holders = [make(seg) for seg in segs]
    assert [h.get_hostname() for h in holders] == segs
    coord = make("localhost", segment=0)
    cfg = ReplicateConfig()
    cfg.preferred_segment = segs[0]
    value = os.urandom(64 * 1024)
    assert coord.put("k", value, cfg) == 0 and _replicas(coord, "k") == [segs[0]]
    task, err = coord.create_copy_task("k", segs[1:])
    assert err == 0 and isinstance(task, tuple) and len(task) == 2
    resp = _done(coord, task)
    assert resp.status == TaskStatus.SUCCESS and resp.type == TaskType.REPLICA_COPY
    assert _replicas(coord, "k") == sorted(segs) and coord.get("k") == value
    task, err = coord.create_move_task("k", segs[0], segs[0])
    assert err == INVALID_PARAMS  # onto its own source
    assert coord.put("m", value, cfg) == 0
    task, err = coord.create_move_task("m", segs[0], segs[2])
    assert err == 0 and _done(coord, task).status == TaskStatus.SUCCESS
    assert _replicas(coord, "m") == [segs[2]] and coord.get("m") == value
    assert coord.create_copy_task("nope", segs)[1] == OBJECT_NOT_FOUND
    assert coord.create_move_task("nope", segs[0], segs[1])[1] == OBJECT_NOT_FOUND
    assert coord.create_copy_task("k", ["unknown:1"])[1] == INVALID_PARAMS
    assert coord.create_move_task("m", "unknown:1", segs[0])[1] == INVALID_PARAMS
    assert coord.create_move_task("m", segs[1], segs[0])[1] == INVALID_PARAMS  # no replica
    assert coord.query_task((12345, 99)) == (None, TASK_NOT_FOUND)
    # several preferred segments: one replica on each
    two = ReplicateConfig()
    two.replica_num = 2
    two.preferred_segments = segs[1:]
    assert coord.put("two", b"x" * 1000, two) == 0 and _replicas(coord, "two") == sorted(segs[1:])


def test_async_store(env) -> None:
    _, make = env
    s = make(cls=MooncakeDistributedStoreAsync)

    async def go() -> tuple:
        rc = await s.async_put("a", b"hello")
        got = await s.async_get("a")
        exist = await s.async_batch_is_exist(["a", "b"])
        return rc, got, exist

    assert asyncio.run(go()) == (0, b"hello", [1, 0])
    with pytest.raises(AttributeError):
        s.async_no_such_method  # noqa: B018
    with pytest.raises(AttributeError):
        s.nothing  # noqa: B018


def test_buffer_pool(env) -> None:
    _, make = env
    s = make(local=64 * 1024)
    pool = BufferPool(s, min_size_class=4096, alignment=4096)
    lease = pool.acquire(1000)
    assert lease.size == 1000 and lease.ptr % 64 == 0
    lease.buffer[:5] = b"hello"
    assert s.put_from("bp", lease.ptr, 5) == 0 and s.get("bp") == b"hello"
    view = lease.buffer
    with pytest.raises(RuntimeError, match="exported views"):
        lease.release()
    del view
    gc.collect()
    lease.release()
    big = pool.acquire(64 * 1024)  # the whole local region
    over = pool.acquire(10, block=False)  # an overflow buffer, registered on its own
    assert s.put_from("ov", over.ptr, 10) == 0
    with pytest.raises(RuntimeError, match="active leases"):
        pool.close()
    big.release()
    over.release()
    with pytest.raises(RuntimeError, match="capacity"):
        pool.acquire(1 << 40)
    pool.close()
    with pytest.raises(RuntimeError, match="alignment"):
        BufferPool(s, alignment=12345)
    one = BufferPool(s, max_regions=1, block_on_exhaustion=False)
    held = one.acquire(1)
    with pytest.raises(RuntimeError, match="exhausted"):
        one.acquire(1)
    held.release()
    one.close()


def test_setup_dummy_through_real_client(env) -> None:
    cl, make = env
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pymooncake.compat", "real-client", "--master-server-address",
         cl.master_addr, "--metadata-server", cl.metadata_url, "--port", str(port),
         "--global-segment-size", str(16 * MB)], stdout=subprocess.PIPE, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    try:
        info = json.loads(proc.stdout.readline())
        assert info["event"] == "ready"
        dummy = MooncakeDistributedStore()
        assert dummy.setup_dummy(4 * MB, 4 * MB, f"127.0.0.1:{port}") == 0
        assert dummy.put("d", b"payload") == 0
        # the object lies in the real client's memory, as with Mooncake's dummy clients
        assert _replicas(dummy, "d") == [info["segment"]]
        assert dummy.get("d") == b"payload"
        dummy.close()
        assert MooncakeDistributedStore().setup_dummy(1, 1, f"127.0.0.1:{free_port()}") \
            == -900  # RPC_FAIL: no real client there
    finally:
        proc.terminate()
        proc.wait(10)


def test_p2phandshake_uses_env_metadata(env, monkeypatch) -> None:
    cl, make = env
    monkeypatch.setenv("PYMOONCAKE_P2P_METADATA_SERVER", cl.metadata_url)
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", 4 * MB, 4 * MB, "tcp", "",
                   cl.master_addr) == 0
    try:
        other = make()
        assert s.put("p2p", b"v") == 0 and other.get("p2p") == b"v"
    finally:
        s.close()


def test_registered_check_needs_setup() -> None:
    s = MooncakeDistributedStore()
    assert s._registered(ctypes.addressof(ctypes.c_char()), 1) is False
    assert s.create_copy_task("k", ["a"])[1] != 0


def test_full_object_parallelism_forms_and_pool(env) -> None:
    _, make = env
    s = make()
    arr = np.arange(24, dtype=np.float32).reshape(4, 6)
    assert s.put_tensor_with_parallelism("fp", arr) == 0  # no parallelism: a full object
    assert np.array_equal(np.asarray(s.get_tensor("fp")), arr)
    assert np.array_equal(np.asarray(s.get_tensor_with_parallelism("fp")), arr)
    assert s.batch_upsert_tensor_with_parallelism(["fp", "fq"], [arr + 1, arr]) == [0, 0]
    assert np.array_equal(np.asarray(s.batch_get_tensor_with_parallelism(["fp"])[0]), arr + 1)
    # a layout request that is no layout (no axes / rank / size): -600, reads None
    # (test_compat_parallel.py covers the layout API)
    assert s.put_tensor_with_parallelism("ax", arr, object()) == INVALID_PARAMS
    assert s.put_tensor_with_parallelism("ax", arr, writer_partition=object()) == \
        INVALID_PARAMS
    assert s.get_tensor_with_parallelism("fp", object()) is None
    # Mooncake's memory pool: registered already, register/unregister of it answer 0
    n = 304 + arr.nbytes
    ptr = s.alloc_from_mem_pool(n)
    assert ptr and s.register_buffer(ptr, n) == 0
    got = s.get_tensor_with_parallelism_into("fq", ptr, n)
    assert np.array_equal(np.asarray(got), arr)
    assert s.put_tensor_with_parallelism_from("fr", ptr, n) == 0
    assert s.batch_put_tensor_with_parallelism_from(["fs"], [ptr], [n], [object()]) == [
        INVALID_PARAMS]
    assert s.unregister_buffer(ptr) == 0 and s.put_tensor_from("ft", ptr, n) == 0
    assert s.alloc_from_mem_pool(0) == 0
    # lists that disagree in length: -600 for every key (as Mooncake's batch_get_tensor_into)
    assert s.batch_get_tensor_into(["fp", "x"], [ptr], [n]) == [INVALID_PARAMS] * 2
    # get_into_ranges: a key whose range lists disagree answers -600 for it alone
    assert s.put("gr", b"0123456789") == 0
    res = s.get_into_ranges([ptr], [["gr", "gr"]], [[[0], [8]]], [[[0, 1], [2]]],
                            [[[4, 4], [3]]])
    assert res == [[[INVALID_PARAMS, INVALID_PARAMS], [3]]]
    assert ctypes.string_at(ptr + 8, 3) == b"234"
