"""``pymooncake.store.compat.MooncakeDistributedStore`` driven the way Mooncake's Python API
documentation uses ``mooncake.store.MooncakeDistributedStore`` (setup with positional
arguments or a dict, int return codes, ``b''`` for misses, zero-copy through registered
pointers). Expected codes are Mooncake's (../shared/MOONCAKE.md)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from pymooncake.store.compat import (
    MooncakeDistributedStore,
    ReplicaStatus,
    ReplicateConfig,
    SoftPinAction,
)
from tests.store.procs import wait_for_port

pytestmark = pytest.mark.integration

MB = 1 << 20
OBJECT_NOT_FOUND, OBJECT_HAS_LEASE, INVALID_PARAMS = -704, -706, -600


class _MooncakeCluster:
    """Mooncake's own master (wheel ``mooncake-transfer-engine-non-cuda``), to check that
    this file's expectations are Mooncake's."""

    def __init__(self) -> None:
        import subprocess

        from pymooncake.bench import store as bench

        exe = bench._mooncake_master()
        mport, hport = bench._free_port(), bench._free_port()
        self.proc = subprocess.Popen(
            [exe, f"--rpc_port={mport}", "--enable_http_metadata_server=true",
             "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={hport}",
             f"--metrics_port={bench._free_port()}", "--default_kv_lease_ttl=500"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.master_addr = f"127.0.0.1:{mport}"
        self.metadata_url = f"http://127.0.0.1:{hport}/metadata"

        wait_for_port(mport)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(5)


def _mooncake_available() -> bool:
    from pymooncake.bench import store as bench

    return os.environ.get("PYMOONCAKE_COMPAT_VS_MOONCAKE") == "1" and bench.mooncake_available()


@pytest.fixture(params=["pymooncake", "mooncake"])
def env(request, cluster_factory):
    impl = request.param
    if impl == "mooncake":
        if not _mooncake_available():
            pytest.skip("set PYMOONCAKE_COMPAT_VS_MOONCAKE=1 with the Mooncake wheel installed")
        import mooncake.store as module
        cl = _MooncakeCluster()
    else:
        import pymooncake.store.compat as module
        cl = cluster_factory("--default-kv-lease-ttl", "500")
    Store = module.MooncakeDistributedStore
    stores = []

    def make(segment: int = 16 * MB, local: int = 16 * MB):
        s = Store()
        rc = s.setup("localhost", cl.metadata_url, segment, local, "tcp", "", cl.master_addr)
        assert rc == 0
        stores.append(s)
        return s

    yield cl, make, module
    for s in stores:
        s.close()
    if impl == "mooncake":
        cl.close()


def test_module_level_types() -> None:
    cfg = ReplicateConfig()
    assert (cfg.replica_num, cfg.with_hard_pin, cfg.preferred_segment) == (1, False, "")
    assert cfg.soft_pin_action == SoftPinAction.PRESERVE and cfg.soft_pin_ttl_ms is None
    assert {"ENABLE", "DISABLE", "PRESERVE"} <= set(SoftPinAction.__members__)
    assert {"PROCESSING", "COMPLETE"} <= set(ReplicaStatus.__members__)
    s = MooncakeDistributedStore()
    assert s.health_check() == 1  # not initialised
    assert s.close() == 0


def test_put_get_exist_size_remove(env) -> None:
    cl, make, mod = env
    store = make()
    assert store.health_check() == 0
    host, _, port = store.get_hostname().rpartition(":")
    assert host and port.isdigit()
    assert store.put("hello_key", b"Hello, Mooncake Store!") == 0
    assert store.get("hello_key") == b"Hello, Mooncake Store!"
    assert store.get("missing") == b""
    assert store.put("", b"x") == INVALID_PARAMS  # observed on Mooncake 0.3.13
    assert store.put("empty", b"") == INVALID_PARAMS
    assert store.put("big", b"x" * (17 * MB)) == INVALID_PARAMS  # > local_buffer_size
    assert store.is_exist("big") == 0 and store.is_exist("empty") == 0
    assert store.is_exist("hello_key") == 1 and store.is_exist("missing") == 0
    assert store.batch_is_exist(["hello_key", "missing"]) == [1, 0]
    assert store.get_size("hello_key") == 22 and store.get_size("missing") == OBJECT_NOT_FOUND
    # a put of an existing key returns 0 and keeps the old value
    assert store.put("hello_key", b"other") == 0
    assert store.get("hello_key") == b"Hello, Mooncake Store!"
    # the get above holds a read lease: remove is refused, force removes anyway
    assert store.remove("hello_key") == OBJECT_HAS_LEASE
    assert store.remove("hello_key", force=True) == 0
    assert store.remove("hello_key") == OBJECT_NOT_FOUND
    # a fresh object has no lease: removable at once
    assert store.put("fresh", b"x") == 0 and store.remove("fresh") == 0
    keys = [f"batch_{i}" for i in range(5)]
    vals = [np.random.bytes(1000 + i) for i in range(5)]
    assert store.put_batch(keys, vals) == 0
    assert store.get_batch(keys + ["nope"]) == vals + [b""]
    time.sleep(0.6)  # leases lapse
    assert store.remove_all() == 5
    assert store.batch_is_exist(keys) == [0] * 5


def test_remove_force_is_converted_as_the_binding_does(env) -> None:
    """``force`` takes what pybind11's bool conversion takes: ``None`` and numbers by their
    truth value, anything else is a ``TypeError`` (observed on the Mooncake 0.3.13 wheel:
    ``remove("k", 1)``, ``0``, ``2.0`` and ``None`` return 0; ``"yes"`` and ``[1]`` raise
    ``TypeError`` in ``remove``, ``remove_all``, ``batch_remove``, ``remove_by_regex``)."""
    _cl, make, _mod = env
    store = make()
    assert store.put("k", b"abc") == 0 and store.get("k") == b"abc"  # a read lease now
    assert store.remove("k", 0) == OBJECT_HAS_LEASE
    assert store.remove("k", 1) == 0           # 1 is force=True: the lease does not block
    for force in (0, 2.0, None):
        assert store.put("k", b"abc") == 0
        assert store.remove("k", force) == 0
    for call in (lambda f: store.remove("k", f), lambda f: store.remove_all(f),
                 lambda f: store.batch_remove(["k"], f),
                 lambda f: store.remove_by_regex("k", f)):
        for bad in ("yes", [1]):
            with pytest.raises(TypeError, match="incompatible function arguments"):
                call(bad)
    assert store.put("k2", b"x") == 0 and store.remove_all(1) == 1


def test_zero_copy_pointers_and_buffer_handle(env) -> None:
    cl, make, mod = env
    store = make()
    src = np.frombuffer(np.random.bytes(64 * 1024), dtype=np.uint8).copy()
    dst = np.zeros(128 * 1024, dtype=np.uint8)
    assert store.register_buffer(src.ctypes.data, src.nbytes) == 0
    assert store.register_buffer(dst.ctypes.data, dst.nbytes) == 0
    assert store.put_from("zc", src.ctypes.data, 30) == 0
    assert store.get_into("zc", dst.ctypes.data, dst.nbytes) == 30
    assert bytes(dst[:30]) == bytes(src[:30])
    ptrs = [src.ctypes.data + 100, src.ctypes.data + 5000]
    assert store.batch_put_from(["a", "b"], ptrs, [1000, 2000]) == [0, 0]
    got = store.batch_get_into(["a", "missing"], [dst.ctypes.data, dst.ctypes.data + 4096],
                               [4096, 4096])
    assert got == [1000, OBJECT_NOT_FOUND]
    assert bytes(dst[:1000]) == bytes(src[100:1100])
    assert store.get_into("b", dst.ctypes.data, 10) == INVALID_PARAMS  # buffer too small
    h = store.get_buffer("b")
    assert h is not None and h.size() == 2000 and h.ptr() != 0
    assert bytes(memoryview(h)) == bytes(src[5000:7000])
    assert store.get_buffer("missing") is None
    assert store.unregister_buffer(src.ctypes.data) == 0
    assert store.unregister_buffer(src.ctypes.data) != 0


def test_replicate_config_and_soft_pin_rules(env) -> None:
    cl, make, mod = env
    store = make()
    ReplicateConfig, SoftPinAction = mod.ReplicateConfig, mod.SoftPinAction  # noqa: N806
    cfg = ReplicateConfig()
    cfg.replica_num = 2  # only one segment: best effort, one replica, still 0
    assert store.put("r2", b"v" * 100, cfg) == 0 and store.get("r2") == b"v" * 100
    bad = ReplicateConfig()
    bad.soft_pin_ttl_ms = 1000  # a TTL without ENABLE
    assert store.put("p", b"x", bad) == INVALID_PARAMS
    bad.soft_pin_action = SoftPinAction.DISABLE
    assert store.put("p", b"x", bad) == INVALID_PARAMS
    ok = ReplicateConfig()
    ok.soft_pin_action = SoftPinAction.ENABLE
    ok.soft_pin_ttl_ms = 60_000
    assert store.put("p", b"x", ok) == 0
    hard = ReplicateConfig()
    hard.with_hard_pin = True
    assert store.put("h", b"y", hard) == 0 and store.get("h") == b"y"
    zero = ReplicateConfig()
    zero.replica_num = 0
    assert store.put("z", b"x", zero) == INVALID_PARAMS
    assert store.is_exist("p") == 1 and store.is_exist("z") == 0


def test_two_stores_share_data_and_dict_setup(env) -> None:
    cl, make, mod = env
    a = make()
    b = type(a)()
    assert b.setup({"local_hostname": "localhost", "metadata_server": cl.metadata_url,
                    "global_segment_size": "16MB", "local_buffer_size": "16MB",
                    "protocol": "tcp", "master_server_addr": cl.master_addr}) == 0
    try:
        val = np.random.bytes(3 * MB)
        assert a.put("shared", val) == 0
        assert b.get("shared") == val
        if not mod.__name__.startswith("mooncake"):  # numpy in tensor helpers: extension
            arr = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
            assert a.put_tensor("t", arr) == 0
            got = b.get_tensor("t")  # a torch tensor once torch is loaded (as Mooncake's)
            got = got.numpy() if hasattr(got, "numpy") else got
            assert got.dtype == np.float32 and got.shape == (2, 3, 4)
            assert np.array_equal(got, arr)
            assert b.batch_put_tensor(["t1", "t2"], [arr[0], arr[1]]) == [0, 0]
            assert [x.shape for x in a.batch_get_tensor(["t1", "t2"])] == [(3, 4), (3, 4)]
            assert a.batch_get_tensor(["none"]) == [None]
    finally:
        b.close()
    bad = type(a)()
    assert bad.setup({"local_hostname": "localhost", "metadata_server": cl.metadata_url,
                      "global_segment_size": "50%", "master_server_addr": cl.master_addr}) != 0
    reader = type(a)()
    assert reader.setup("localhost", cl.metadata_url, 0, 0, "tcp", "", cl.master_addr) == 0
    try:
        assert reader.put("cannot", b"x") != 0  # local_buffer_size=0: put fails
        assert reader.get("shared") == b""  # reads need a local buffer too
    finally:
        reader.close()


def test_torch_tensor_round_trip(env) -> None:
    torch = pytest.importorskip("torch")
    cl, make, mod = env
    store = make()
    t = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    assert store.put_tensor("bf16", t) == 0
    got = store.get_tensor("bf16")
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16
    assert torch.equal(got, t)
