"""The whole public ``MooncakeDistributedStore`` API against a real pymooncake master.

``compat_api_scenario.py`` drives every covered method; its output on pymooncake must equal
the output recorded from Mooncake's wheel (``compat_api_mooncake.json``, recorded with
``mooncake-transfer-engine-non-cuda`` 0.3.13.post1 and ``mooncake_master
--default_kv_lease_ttl=500``). ``test_same_as_mooncake_wheel`` re-records it live: set
``PYMOONCAKE_COMPAT_VS_MOONCAKE=1`` and ``PYMOONCAKE_MOONCAKE_PYTHON`` to a Python with the
wheel installed (a separate venv; docs/store.md "Compatibility" has the commands).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pymooncake.store.compat import (
    MooncakeDistributedStore,
    ObjectDataType,
    ReplicaStatus,
    ReplicateConfig,
    SoftPinAction,
    TaskStatus,
)
from tests.store.procs import wait_for_port

from . import compat_api_scenario as scenario

pytestmark = pytest.mark.integration

HERE = Path(__file__).parent
MB = 1 << 20


def test_scenario_matches_recorded_mooncake(cluster_factory) -> None:
    cl = cluster_factory("--default-kv-lease-ttl", "500")
    got = scenario.run("pymooncake.store.compat", cl.master_addr, cl.metadata_url)
    want = json.loads((HERE / "compat_api_mooncake.json").read_text())
    diff = {k: (want.get(k), got.get(k)) for k in set(want) | set(got)
            if want.get(k) != got.get(k)}
    assert not diff, diff
    # the codes that matter most, spelled out
    assert got["put.existing"] == 0 and got["get.k1"] == {"b": b"hello".hex()}
    assert got["get.u1.shrunk"] == {"b": b"3".hex()} and got["size.u1"] == 20
    assert got["get_into.small"] == -600 and got["get_into.missing"] == -704
    assert got["batch_remove"] == [0, -704] and got["batch_remove.leased"] == [-706]
    assert got["remove_by_regex"] == 2 and got["batch_replica_clear"] == ["b1"]
    assert got["get_into_ranges"] == [[[4, 3], [2]], [[2]]]
    assert got["cfg.set.replica_num='x'"] == {"exc": "TypeError"}


def _mooncake_python() -> str | None:
    if os.environ.get("PYMOONCAKE_COMPAT_VS_MOONCAKE") != "1":
        return None
    py = os.environ.get("PYMOONCAKE_MOONCAKE_PYTHON", sys.executable)
    probe = subprocess.run([py, "-c", "import mooncake.store"], capture_output=True)
    master = Path(py).parent / "mooncake_master"
    return py if probe.returncode == 0 and master.exists() else None


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_same_as_mooncake_wheel(cluster_factory) -> None:
    py = _mooncake_python()
    if py is None:
        pytest.skip("set PYMOONCAKE_COMPAT_VS_MOONCAKE=1 and PYMOONCAKE_MOONCAKE_PYTHON to a "
                    "Python with mooncake-transfer-engine-non-cuda (and its mooncake_master)")
    mport, hport = _port(), _port()
    master = subprocess.Popen(
        [str(Path(py).parent / "mooncake_master"), f"--rpc_port={mport}",
         "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
         f"--http_metadata_server_port={hport}", f"--metrics_port={_port()}",
         "--default_kv_lease_ttl=500"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(mport)
        res = subprocess.run([py, str(HERE / "compat_api_scenario.py"), "mooncake.store",
                              f"127.0.0.1:{mport}", f"http://127.0.0.1:{hport}/metadata"],
                             capture_output=True, timeout=120)
        assert res.returncode == 0, res.stderr.decode()[-2000:]
        theirs = json.loads(res.stdout)
    finally:
        master.kill()
        master.wait(5)
    cl = cluster_factory("--default-kv-lease-ttl", "500")
    ours = scenario.run("pymooncake.store.compat", cl.master_addr, cl.metadata_url)
    diff = {k: (theirs.get(k), ours.get(k)) for k in set(theirs) | set(ours)
            if theirs.get(k) != ours.get(k)}
    assert not diff, diff


def test_types_without_a_store() -> None:
    cfg = ReplicateConfig()
    assert str(cfg).startswith("ReplicateConfig: { replica_num: 1, nof_replica_num: 0")
    with pytest.raises(AttributeError):
        cfg.no_such_field = 1  # type: ignore[attr-defined]
    cfg.preferred_segments = ("a", "b")
    assert cfg.preferred_segments == ["a", "b"]
    cfg.data_type = ObjectDataType.KVCACHE
    cfg.soft_pin_action = SoftPinAction.ENABLE
    cfg.soft_pin_ttl_ms = 1000
    typed = cfg.to_typed()
    assert typed.soft_pin and typed.soft_pin_ttl_ms == 1000 and typed.preferred_segment == "a"
    assert str(ReplicaStatus.COMPLETE) == "ReplicaStatus.COMPLETE"
    assert (TaskStatus.FAILED, TaskStatus.SUCCESS) == (2, 3)
    s = MooncakeDistributedStore()
    assert s.get("x") == b"" and s.get_buffer("x") is None and s.get_replica_desc("x") == []
    assert s.put("x", b"y") < 0 and s.batch_remove(["x"])[0] < 0
    with pytest.raises(TypeError):
        s.put("x", "a str is not a buffer")


@pytest.fixture
def store(cluster_factory):
    cl = cluster_factory()  # default lease: a read on a loaded machine may take > 500 ms
    made = []

    def make(segment: int = 16 * MB, local: int = 16 * MB, host: str = "localhost"):
        s = MooncakeDistributedStore()
        assert s.setup(host, cl.metadata_url, segment, local, "tcp", "", cl.master_addr) == 0
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def test_hostname_is_the_segment_and_close_drops_its_data(store) -> None:
    a, b = store(), store()
    host, _, port = a.get_hostname().rpartition(":")
    assert host == "localhost" and 12300 <= int(port) < 14300
    cfg = ReplicateConfig()
    cfg.preferred_segment = b.get_hostname()
    assert a.put("on_b", b"x" * 1000, cfg) == 0
    (d,) = a.get_replica_desc("on_b")
    assert d.get_memory_descriptor().buffer_descriptor.transport_endpoint == b.get_hostname()
    assert d.status == ReplicaStatus.COMPLETE
    assert a.batch_replica_clear(["on_b"], segment_name=a.get_hostname()) == []
    assert b.close() == 0 and b.health_check() == 1
    assert a.get("on_b") == b""  # its only replica lived in b's segment
    assert a.is_exist("on_b") == 0


def test_upsert_reader_never_sees_mixed_bytes(store) -> None:
    w, r = store(), store()
    sizes = [100, 5000, 70_000, 3]
    for i, n in enumerate(sizes * 3):
        val = bytes([i % 251]) * n
        assert w.upsert("u", val) == 0
        got = r.get("u")
        assert got == val, (i, len(got))
        assert r.get_size("u") == n


def test_tensor_forms(store) -> None:
    s = store()
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    cfg = ReplicateConfig()
    cfg.with_hard_pin = True
    assert s.pub_tensor("t", arr, cfg) == 0
    assert s.upsert_tensor("t", arr[:2]) == 0
    assert s.get_tensor("t").shape == (2, 4)
    buf = np.zeros(4096, dtype=np.uint8)
    assert s.register_buffer(buf.ctypes.data, buf.nbytes) == 0
    t = s.get_tensor_into("t", buf.ctypes.data, buf.nbytes)
    assert np.array_equal(t, arr[:2])
    n = s.get_size("t")
    assert s.put_tensor_from("t2", buf.ctypes.data, n) == 0  # serialised bytes round trip
    assert np.array_equal(s.get_tensor("t2"), arr[:2])
    assert s.batch_upsert_tensor(["t", "t3"], [arr, arr]) == [0, 0]
    got = s.batch_get_tensor_into(["t3", "none"], [buf.ctypes.data, buf.ctypes.data + 2048],
                                  [2048, 2048])
    assert np.array_equal(got[0], arr) and got[1] is None
    assert s.put_tensor("bad", object()) == -600


def test_setup_chooses_another_port_when_its_pick_is_taken(cluster_factory, monkeypatch):
    """``setup("localhost", ...)`` picks the engine's port itself; another process can bind
    it between the pick and the bind (four benchmark clients starting at once did). Then
    the next pick is tried, as Mooncake's client retries, instead of ``RPC_FAIL``."""
    from pymooncake.store.compat import _codes, _store

    cl = cluster_factory()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        picks = iter([busy, busy, _codes.free_port()])
        monkeypatch.setattr(_store, "free_port", lambda: next(picks))
        s = MooncakeDistributedStore()
        try:
            assert s.setup("localhost", cl.metadata_url, 1 * MB, 1 * MB, "tcp", "",
                           cl.master_addr) == 0
            assert not s.get_hostname().endswith(f":{busy}")
            assert s.put("k", b"v" * 10) == 0 and s.get("k") == b"v" * 10
        finally:
            s.close()
        # a port the caller names is not replaced: that bind error is the caller's
        s2 = MooncakeDistributedStore()
        assert s2.setup(f"localhost:{busy}", cl.metadata_url, 1 * MB, 1 * MB, "tcp", "",
                        cl.master_addr) == -900
        s2.close()
