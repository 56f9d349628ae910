"""Arguments of the wrong Python type on the compat store, as Mooncake's pybind11 bindings
answer them (real_client/store_py.cpp): keys are ``std::string`` (``str`` or ``bytes``,
one object either way), anything else raises ``TypeError`` ("incompatible function
arguments"), never an error code; and the newcomer's other findings of issue 18 (a
``ReadTarget`` of another type, a second ``setup``, ``TensorParallelism.axes``, an
out-of-range ``split_dim``). A real master."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from pymooncake.store.compat import (
    MooncakeDistributedStore,
    ParallelAxis,
    ReplicateConfig,
    TensorParallelism,
)

MB = 1 << 20
INVALID_PARAMS = -600


@pytest.fixture
def store(cluster_factory):
    cl = cluster_factory()
    s = MooncakeDistributedStore()
    assert s.setup("localhost", cl.metadata_url, 16 * MB, 16 * MB, "tcp", "",
                   cl.master_addr) == 0
    s.cluster = cl
    yield s
    s.close()


@pytest.mark.integration
def test_keys_are_str_or_bytes_and_other_types_raise_type_error(store) -> None:
    s = store
    assert s.put("k", b"value") == 0
    # bytes keys are std::string too: the same object as the str key
    assert s.get(b"k") == b"value" and s.get_size(b"k") == 5 and s.is_exist(b"k") == 1
    assert s.batch_is_exist([b"k", "k", "nope"]) == [1, 1, 0]
    assert s.put(b"k2", b"xy") == 0 and s.get("k2") == b"xy"
    for call in (lambda: s.put(123, b"x"), lambda: s.get(None), lambda: s.get(123),
                 lambda: s.is_exist(123), lambda: s.get_size(1.5), lambda: s.remove(7),
                 lambda: s.get_tensor(None)):
        with pytest.raises(TypeError, match=r"\(\): incompatible function arguments: key "
                                            r"takes str \(or bytes: std::string\)"):
            call()
    with pytest.raises(TypeError, match=r"get_batch\(\): incompatible function arguments: "
                                        r"keys\[1\] takes str"):
        s.get_batch(["k", 5])
    with pytest.raises(TypeError, match=r"batch_is_exist\(\): incompatible function "
                                        r"arguments: keys takes a list"):
        s.batch_is_exist("k")
    with pytest.raises(TypeError, match=r"get\(\): incompatible .* got None"):
        s.get(key=None)                                   # by keyword, too
    # a config of the wrong type: TypeError (was -600), the object not written
    with pytest.raises(TypeError, match=r"put\(\): incompatible function arguments: config "
                                        r"takes ReplicateConfig, got 'cfg'"):
        s.put("k3", b"x", "cfg")
    assert s.is_exist("k3") == 0
    assert s.put("k3", b"x", ReplicateConfig()) == 0


@pytest.mark.integration
def test_a_target_without_mode_and_parallelism_is_logged_and_none(store, caplog) -> None:
    """Not a TypeError: Mooncake's ``target`` is a ``py::object`` read by attribute
    (store_py_internal.h, parse_read_target_spec: "ReadTarget must provide mode and
    parallelism", then None)."""
    with caplog.at_level(logging.ERROR):
        assert store.get_tensor_with_parallelism("p2", "full") is None
    assert "p2: ReadTarget must provide mode and parallelism, got 'full'" in caplog.text


@pytest.mark.integration
def test_split_dim_outside_the_tensor_is_logged_like_other_invalid_parallelisms(
        store, caplog) -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    for dim in (5, -1):
        a = ParallelAxis()
        a.kind, a.rank, a.size = "tp", 0, 2
        a.split_dim = dim
        p = TensorParallelism()
        p.axes = [a]
        caplog.clear()
        with caplog.at_level(logging.ERROR):
            assert store.put_tensor_with_parallelism(f"t{dim}", t, p) == INVALID_PARAMS
        assert "invalid parallelism" in caplog.text, dim


def test_axes_of_the_wrong_type_get_the_class_s_own_message() -> None:
    p = TensorParallelism()
    for bad in (None, 3, "tp"):
        with pytest.raises(TypeError, match="axes must be a list of ParallelAxis, got"):
            p.axes = bad
    assert p.axes == []


@pytest.mark.integration
def test_a_second_setup_checks_its_arguments_and_keeps_the_client(store) -> None:
    """Mooncake's second ``setup`` builds a new client (store_py.cpp, init_real_client);
    the facade re-checks the arguments (a bad size is -600, as on a first setup) and keeps
    the connected client (docs/compat.md)."""
    cl = store.cluster
    assert store.put("kept", b"1") == 0
    name = store.get_hostname()
    assert store.setup("localhost", cl.metadata_url, "50%", 16 * MB, "tcp", "",
                       cl.master_addr) == INVALID_PARAMS
    assert store.setup("localhost", cl.metadata_url, 16 * MB, 16 * MB, "carrier-pigeon",
                       "", cl.master_addr) == INVALID_PARAMS
    assert store.setup("localhost", cl.metadata_url, 16 * MB, 16 * MB, "tcp", "",
                       cl.master_addr) == 0
    assert store.get_hostname() == name and store.get("kept") == b"1"
    assert np.frombuffer(store.get("kept"), dtype=np.uint8).tolist() == [ord("1")]
    assert store.close() == 0 and store.get("kept") == b""    # close, then setup: a new one
    assert store.setup("localhost", cl.metadata_url, 16 * MB, 16 * MB, "tcp", "",
                       cl.master_addr) == 0
    assert store.put("again", b"2") == 0 and store.get("again") == b"2"


@pytest.mark.integration
def test_setup_string_arguments_of_another_type_raise_and_codes_log_their_reason(
        cluster_factory, caplog) -> None:
    """``setup(123, ...)`` raises pybind's TypeError (it printed a bind traceback from a
    thread and returned -1); a -600 says why in the log (Mooncake logs its errors)."""
    cl = cluster_factory()
    s = MooncakeDistributedStore()
    for args in ((123, cl.metadata_url), ("localhost", None), ("localhost", cl.metadata_url)):
        kw = {"master_server_addr": 50051} if args[1] == cl.metadata_url else {}
        with pytest.raises(TypeError, match="incompatible function arguments"):
            s.setup(*args, 16 * MB, 16 * MB, "tcp", "", **kw)
    with caplog.at_level(logging.WARNING, logger="pymooncake.store.compat._codes"):
        assert s.setup("localhost", cl.metadata_url, "50%", 16 * MB, "tcp", "",
                       cl.master_addr) == INVALID_PARAMS
    assert "a percentage is not accepted" in caplog.text
    assert s.setup("localhost", cl.metadata_url, MB, MB, "tcp", "", cl.master_addr) == 0
    try:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pymooncake.store.compat._codes"):
            assert s.put("big", b"x" * (4 * MB)) != 0        # a 1 MiB local buffer
            assert "larger than local_buffer_size (1048576 bytes)" in caplog.text
            caplog.clear()
            assert s.get("missing") == b""
        assert caplog.text == ""                          # a miss is not a warning
    finally:
        s.close()
