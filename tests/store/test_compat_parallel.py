"""Mooncake's unified-parallelism layout API on the compat store (``ParallelAxis``,
``TensorParallelism``, ``ReadTarget``, writer partitions; Mooncake's
docs/source/design/store/unified-parallel-tensor-io.md). Expected shards and full tensors
are computed independently with numpy (``np.split`` / the original array), never with the
store's own slicing. The first tests are pure; the rest run against a real master."""

from __future__ import annotations

import numpy as np
import pytest

from pymooncake.store.compat import (
    MooncakeDistributedStore,
    ParallelAxis,
    ReadTarget,
    TensorParallelism,
)
from pymooncake.store.compat import _parallel_spec as ps

INVALID_PARAMS = -600
MB = 1 << 20


def axis(kind: str, rank: int, size: int, split_dim: int | None = None, **extra: int
         ) -> ParallelAxis:
    a = ParallelAxis()
    a.kind, a.rank, a.size, a.split_dim = kind, rank, size, split_dim
    for k, v in extra.items():
        setattr(a, k, v)
    return a


def par(*axes: ParallelAxis) -> TensorParallelism:
    p = TensorParallelism()
    p.axes = list(axes)
    return p


def target(mode: str, parallelism: TensorParallelism | None = None) -> ReadTarget:
    t = ReadTarget()
    t.mode, t.parallelism = mode, parallelism
    return t


class Part:  # a writer partition: any object with rank / size / split_dim, as Mooncake
    def __init__(self, rank: int, size: int, split_dim: int) -> None:
        self.rank, self.size, self.split_dim = rank, size, split_dim


# -- pure: validation, key names, manifests, slicing ---------------------------------


def test_validation_rules_and_key_names() -> None:
    good = ps.validate(par(axis("tp", 1, 4, 0), axis("PP", 0, 2, stage_id=7),
                           axis("dp", 1, 2)))
    assert good is not None and [a.kind for a in good] == ["tp", "pp", "dp"]  # as given
    assert ps.shard_key("k", good) == "k__dp_1of2__tp_1of4_sd0__pp_0of2_sid7"
    assert ps.group_key("k", good) == "k__dp_1of2__pp_0of2_sid7"
    assert ps.shard_key("k", ps.validate(par(axis("tp", 3, 4, 1)))) == "k_tp_3"
    assert ps.writer_key("k", 2, 3, 0) == "k__writer_2of3_sd0"
    bad = [par(), par(axis("tp", 0, 2)), par(axis("dp", 0, 2, 0)), par(axis("ep", 0, 2)),
           par(axis("pp", 0, 2)), par(axis("tp", 2, 2, 0)), par(axis("xx", 0, 1)),
           par(axis("tp", 0, 2, 0), axis("tp", 1, 2, 0)),
           par(*[axis(k, 0, 1, 0 if k == "tp" else None, expert_id=1, stage_id=1)
                 for k in ("dp", "tp", "ep", "pp", "dp")]), object()]
    assert [ps.validate(b) for b in bad] == [None] * len(bad)
    with pytest.raises(TypeError):
        axis("tp", "0", 2, 0)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="Unsupported ReadTarget mode"):
        target("whole")
    assert target("FULL").mode == "full"
    # value semantics: assigning axes copies them, as Mooncake's pybind fields
    a = axis("tp", 0, 2, 0)
    p = par(a)
    a.rank = 1
    assert p.axes[0].rank == 0


def test_manifest_round_trip_and_byte_slicing() -> None:
    m = ps.manifest(11, (4, 10, 6), 1, 5)
    assert len(m) == 96 and ps.parse_manifest(m) == (11, (4, 10, 6), 1, 5)
    assert ps.parse_manifest(b"\0" * 96) is None
    x = np.arange(4 * 10 * 6, dtype=np.float16).reshape(4, 10, 6)
    data, shape = ps.slice_dim(memoryview(x.tobytes()), x.shape, 1, 2, 7, 2)
    assert shape == (4, 5, 6)
    assert np.array_equal(np.frombuffer(data, np.float16).reshape(shape), x[:, 2:7, :])
    parts = [(p.tobytes(), p.shape) for p in np.split(x, 5, axis=1)]
    joined, shape = ps.concat_dim(parts, 1, 2)
    assert shape == x.shape and joined == x.tobytes()


# -- against a real master -----------------------------------------------------------


@pytest.fixture
def store(cluster_factory):
    cl = cluster_factory("--default-kv-lease-ttl", "500")
    s = MooncakeDistributedStore()
    assert s.setup("localhost", cl.metadata_url, 64 * MB, 32 * MB, "tcp", "",
                   cl.master_addr) == 0
    yield s
    s.close()


def _registered(s: MooncakeDistributedStore, n: int) -> tuple[np.ndarray, int]:
    buf = np.zeros(n, dtype=np.uint8)
    ptr = int(buf.ctypes.data)
    assert s.register_buffer(ptr, n) == 0
    return buf, ptr


@pytest.mark.integration
def test_single_tp_shards_reshard_and_full(store) -> None:
    x = np.arange(6 * 8, dtype=np.float32).reshape(6, 8)
    for r, shard in enumerate(np.split(x, 4, axis=1)):  # the caller holds the shards
        assert store.put_tensor_with_parallelism("w", shard, par(axis("tp", r, 4, 1))) == 0
    assert [store.is_exist(f"w_tp_{r}") for r in range(4)] == [1] * 4  # Mooncake's keys
    assert store.is_exist("w__parallelism_manifest") == 1
    for r, want in enumerate(np.split(x, 4, axis=1)):  # same layout: the stored shard
        got = store.get_tensor_with_parallelism("w", target("shard", par(axis("tp", r, 4, 1))))
        assert np.array_equal(np.asarray(got), want)
        assert np.array_equal(np.asarray(store.get_tensor_with_tp("w", r, 4, 1)), want)
    for size, dim in ((2, 1), (8, 1), (3, 0), (2, 0)):  # re-sharding, other split dims too
        for r, want in enumerate(np.split(x, size, axis=dim)):
            t = target("shard", par(axis("tp", r, size, dim)))
            assert np.array_equal(np.asarray(store.get_tensor_with_parallelism("w", t)), want)
    assert store.get_tensor_with_parallelism("w", target("shard", par(axis("tp", 0, 3, 1)))
                                             ) is None  # 8 is not divisible by 3
    full = store.get_tensor_with_parallelism("w", target("full", par(axis("tp", 2, 3, 0))))
    assert np.array_equal(np.asarray(full), x)
    assert np.array_equal(np.asarray(store.get_tensor_with_parallelism(
        "w", target("full"))), x)
    # a missing shard: no full tensor, no shard that needs it
    assert store.remove("w_tp_2", force=True) == 0
    assert store.get_tensor_with_parallelism("w", target("full")) is None
    assert store.get_tensor_with_parallelism(
        "w", target("shard", par(axis("tp", 1, 2, 1)))) is None
    assert store.get_tensor_with_parallelism(
        "w", target("shard", par(axis("tp", 0, 2, 1)))) is not None


@pytest.mark.integration
def test_multi_axis_writes_cut_the_full_tensor(store) -> None:
    x = np.arange(8 * 6, dtype=np.int32).reshape(8, 6)
    for r in range(2):  # the caller passes the full tensor; the store keeps piece r
        p = par(axis("pp", 0, 2, stage_id=5), axis("tp", r, 2, 0))
        assert store.put_tensor_with_parallelism("m", x, p) == 0
        assert store.upsert_tensor_with_parallelism("m", x + 1, p) == 0
    assert store.is_exist("m__tp_1of2_sd0__pp_0of2_sid5") == 1
    halves = np.split(x + 1, 2, axis=0)
    got = store.batch_get_tensor_with_parallelism(
        ["m", "m"], [target("shard", par(axis("tp", r, 2, 0), axis("pp", 0, 2, stage_id=5)))
                     for r in range(2)])  # axis order does not matter
    assert all(np.array_equal(np.asarray(g), h) for g, h in zip(got, halves, strict=True))
    full_t = target("full", par(axis("tp", 1, 4, 0), axis("pp", 0, 2, stage_id=5)))
    assert np.array_equal(np.asarray(store.get_tensor_with_parallelism("m", full_t)), x + 1)
    other_stage = target("full", par(axis("pp", 0, 2, stage_id=6), axis("tp", 0, 2, 0)))
    assert store.get_tensor_with_parallelism("m", other_stage) is None
    # 6 is not divisible by 4: rejected, nothing stored
    bad = par(axis("dp", 0, 2), axis("tp", 0, 4, 1))
    assert store.batch_put_tensor_with_parallelism(["n", "o"], [x, x], [
        bad, par(axis("dp", 0, 2), axis("tp", 0, 2, 1))]) == [INVALID_PARAMS, 0]
    assert store.get_tensor_with_parallelism("n", target("shard", bad)) is None
    # tags without TP: the tensor is stored as given
    ep = par(axis("ep", 1, 2, expert_id=3))
    assert store.put_tensor_with_parallelism("e", x, ep) == 0
    assert np.array_equal(np.asarray(store.get_tensor_with_parallelism(
        "e", target("shard", ep))), x)


@pytest.mark.integration
def test_writer_partitions_and_exclusive_routes(store) -> None:
    x = np.arange(9 * 4, dtype=np.int16).reshape(9, 4)
    for r in range(3):
        assert store.put_tensor_with_parallelism("wp", x, writer_partition=Part(r, 3, 0)) == 0
    assert store.is_exist("wp__writer_1of3_sd0") == 1
    assert store.is_exist("wp__writer_manifest") == 1
    assert np.array_equal(np.asarray(store.get_tensor_with_parallelism(
        "wp", target("full"))), x)
    for r, want in enumerate(np.split(x, 3, axis=0)):
        got = store.get_tensor_with_parallelism("wp", target("shard",
                                                             par(axis("tp", r, 3, 0))))
        assert np.array_equal(np.asarray(got), want)
    assert store.put_tensor_with_parallelism("wq", x, writer_partition=Part(0, 2, 0)) == \
        INVALID_PARAMS  # 9 rows in 2
    assert store.put_tensor_with_parallelism(
        "wq", x, par(axis("tp", 0, 3, 0)), writer_partition=Part(0, 3, 0)) == INVALID_PARAMS
    assert store.batch_put_tensor_with_parallelism(["a", "b"], [x], None) == [
        INVALID_PARAMS] * 2
    assert store.get_tensor_with_parallelism("wq", target("full")) is None


@pytest.mark.integration
def test_zero_copy_forms(store) -> None:
    x = np.arange(4 * 6, dtype=np.float64).reshape(4, 6)
    assert store.put_tensor("seed", x) == 0
    buf, ptr = _registered(store, 2 * MB)
    n = 304 + x.nbytes
    assert np.array_equal(np.asarray(store.get_tensor_into("seed", ptr, n)), x)
    for r in range(3):  # the full tensor object in registered memory, piece r stored
        p = par(axis("dp", 1, 2), axis("tp", r, 3, 1))
        assert store.put_tensor_with_parallelism_from("z", ptr, n, p) == 0
    assert store.put_tensor_with_parallelism_from("z", ptr, n - 1, p) == INVALID_PARAMS
    out = ptr + MB
    full_t = target("full", par(axis("dp", 1, 2), axis("tp", 0, 3, 1)))
    got = store.get_tensor_with_parallelism_into("z", out, MB, full_t)
    assert np.array_equal(np.asarray(got), x)
    assert bytes(buf[MB:MB + 4]) == (0x4D4F4F4E).to_bytes(4, "little")  # metadata first
    assert store.get_tensor_with_parallelism_into("z", out, 304 + x.nbytes - 1,
                                                  full_t) is None  # does not fit
    shard_t = target("shard", par(axis("dp", 1, 2), axis("tp", 2, 3, 1)))
    got = store.batch_get_tensor_with_parallelism_into(["z", "z"], [out, out + 4096],
                                                       [4096, 4096], [shard_t, full_t])
    assert np.array_equal(np.asarray(got[0]), np.split(x, 3, axis=1)[2])
    assert np.array_equal(np.asarray(got[1]), x)
    assert store.unregister_buffer(ptr) == 0
