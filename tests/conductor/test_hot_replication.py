"""Hot-block replication, pure parts: the sliding reuse window, ``plan_replication``, the
cluster view's replica holders (placement counts them as local hits), the live
replicator's byte budget against a fake master, and turning it off. Expectations are
computed by hand in the comments."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pymooncake.conductor.cluster_view import ClusterState
from pymooncake.conductor.config import ConductorConfig
from pymooncake.conductor.policy import (
    HotBlockConfig,
    InstanceId,
    PrefixIndex,
    RequestInfo,
    ReuseWindow,
    place_prefill_global_cache,
    plan_replication,
)
from pymooncake.conductor.policy.estimators import (
    DecodeEstimator,
    Estimators,
    PrefillEstimator,
    TransferEstimator,
)
from pymooncake.conductor.policy.types import PolicyConfig
from pymooncake.conductor.replication import HotBlockReplicator, segment_of, store_object_key
from pymooncake.conductor.service import Conductor
from pymooncake.rpc.messages import KVEvents, WorkerInfo

P0, P1, P2, STORE = (InstanceId(x) for x in ("p0", "p1", "p2", "store"))


def test_reuse_window_counts_and_expires() -> None:
    w = ReuseWindow(30.0)
    w.record(["a", "b"], 0.0)
    w.record(["a"], 10.0)
    assert (w.count("a"), w.count("b"), w.count("c")) == (2, 1, 0)
    w.expire(30.0)      # the t=0 access is 30 s old: out of a 30 s window
    assert (w.count("a"), w.count("b"), len(w)) == (1, 0, 1)
    w.record([], 41.0)  # expires the t=10 access too
    assert len(w) == 0
    with pytest.raises(ValueError):
        ReuseWindow(0.0)


def _index() -> PrefixIndex:
    idx = PrefixIndex()
    idx.insert(P0, ["k0", "k1", "k2"])
    idx.insert(STORE, ["k0", "k1", "k2"])
    return idx


COUNTS = {"k0": 3, "k1": 3, "k2": 1}


def test_plan_replication_by_hand() -> None:
    idx, cfg = _index(), HotBlockConfig(min_accesses=2)
    keys = ["k0", "k1", "k2", "k3"]          # k3: held by nobody, not reused
    # p0 holds every reused block; p1 lacks k0..k2, of which k0, k1 have >= 2 accesses
    assert plan_replication(keys, idx.holders, [P0, P1], COUNTS.get, cfg, 10) == \
        (P1, ("k0", "k1"))
    # the budget allows one block: the leading one
    assert plan_replication(keys, idx.holders, [P0, P1], COUNTS.get, cfg, 1) == (P1, ("k0",))
    assert plan_replication(keys, idx.holders, [P0, P1], COUNTS.get, cfg, 0) is None
    # two holders already (p0 and the Store): a cap of 2 leaves nothing to copy
    assert plan_replication(keys, idx.holders, [P0, P1], COUNTS.get,
                            HotBlockConfig(2, max_replicas=2), 10) is None
    # p1 holds k0 already: it gains k1 only (k2 is cold)
    idx.insert(P1, ["k0"])
    assert plan_replication(keys, idx.holders, [P1, P2], COUNTS.get, cfg, 10) == \
        (P1, ("k1",))
    # nothing reused: nothing to plan
    assert plan_replication(["x"], idx.holders, [P1], COUNTS.get, cfg, 10) is None


def _info(iid: str, role: str = "prefill") -> WorkerInfo:
    return WorkerInfo(iid, role, "127.0.0.1", 1, "{}", 16, 16 * 100, 8)


def _state() -> ClusterState:
    st = ClusterState(ConductorConfig())
    for iid in ("p0", "p1"):
        st.register(_info(iid), 0.0)
    st.register(_info("d0", "decode"), 0.0)
    st.kv_events(KVEvents("p0", ("k0", "k1"), ()))
    st.kv_events(KVEvents("store", ("k0", "k1"), ()))
    return st


def test_replica_holders_survive_cache_eviction_not_store_loss() -> None:
    st = _state()
    assert st.add_replicas("p1", ["k0", "k1"])
    assert st.index.match(["k0", "k1"], [P0, P1]).local_blocks == (2, 2)
    # p1's prefix cache loads and then evicts k1: its Store replica still counts
    st.kv_events(KVEvents("p1", ("k1",), ()))
    st.kv_events(KVEvents("p1", (), ("k1",)))
    assert st.index.match(["k0", "k1"], [P0, P1]).local_blocks == (2, 2)
    # the Store lost k1 (every replica): p1 holds k0 only; p0's cache still has both
    st.kv_events(KVEvents("store", (), ("k1",)))
    assert st.index.match(["k0", "k1"], [P0, P1]).local_blocks == (2, 1)
    assert st.workers["p1"].replica_keys == {"k0"}
    # the worker leaves: its replicas leave the index with it
    st.remove("p1")
    assert P1 not in st.index.holders("k0")
    assert not st.add_replicas("p1", ["k0"])


def test_placement_uses_the_replica_holder() -> None:
    """p0 is busy for 1 s. Without replicas p1 recomputes the whole prompt: fetching the
    32 reused tokens (64 KiB at 1 MB/s: 0.066 s + 1 ms) costs more than computing them
    (40 tokens at 1 ms: 0.040 s). With the replicas p1 has a local hit: 8 tokens computed,
    0.008 s, no transfer."""
    est = Estimators(PrefillEstimator(0.0, 1e-3, 0.0), TransferEstimator(2048, 1e6, 0.001),
                     DecodeEstimator())
    cfg = PolicyConfig(block_size_tokens=16)
    st = _state()
    st.workers["p0"].prefills["r0"] = (0.0, 1.0)
    req = RequestInfo("r", 40, ("k0", "k1"), 4, 0.0, 1)
    keys, ids = ["k0", "k1"], [P0, P1]
    before = place_prefill_global_cache(req, st.view(0.0), st.index.match(keys, ids), est, cfg)
    assert (before.prefill_instance, before.prefix_blocks, before.transfer_blocks) == \
        ("p1", 0, 0)
    assert before.predicted_ttft_s == pytest.approx(0.040)
    st.add_replicas("p1", keys)
    after = place_prefill_global_cache(req, st.view(0.0), st.index.match(keys, ids), est, cfg)
    assert after.prefill_instance == "p1"
    assert (after.prefix_blocks, after.transfer_blocks) == (2, 0)
    # 40 tokens, 32 reused: 8 computed at 1 ms each, no transfer
    assert after.predicted_ttft_s == pytest.approx(0.008)


class _FakeMaster:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    async def call(self, method: str, params: Any) -> Any:
        if method == "segment_names":
            return ["d0-x", "p0-kv", "p1-kv", "p2-kv"]
        self.calls.append((method, params))
        return [{"r": 1000} for _ in params["keys"]]

    async def close(self) -> None:
        return None


def test_replicator_respects_the_budget_and_gives_bytes_back() -> None:
    async def run() -> None:
        cfg = ConductorConfig(master="127.0.0.1:1", hot_min_accesses=1,
                              hot_replication_budget_bytes=2500)
        st = _state()
        rep = HotBlockReplicator(cfg, st)
        rep._client = fake = _FakeMaster()
        rep.block_bytes, rep.namespace_digest = 1000, "abcdef0123456789ff"
        rep.on_placement(["k0", "k1"], "p0", 0.0)
        await asyncio.gather(*rep._tasks)
        # 2500 B of budget, 1000 B per block: both blocks (2000 B) go to p1's segment
        assert fake.calls == [("replicate", {
            "keys": [store_object_key("abcdef0123456789ff", k) for k in ("k0", "k1")],
            "segment": "p1-kv"})]
        assert (rep.used_bytes, rep.num_replicated) == (2000, 2)
        assert st.workers["p1"].replica_keys == {"k0", "k1"}
        # a third instance joins: 500 B left is less than a block, nothing is copied
        st.register(_info("p2"), 0.0)
        rep.on_placement(["k0", "k1"], "p0", 1.0)
        await asyncio.gather(*rep._tasks)
        assert len(fake.calls) == 1
        # the Store loses k1: its 1000 B come back, p2 gets the one block they allow
        st.kv_events(KVEvents("store", (), ("k1",)))
        rep.forget(["k1"])
        assert rep.used_bytes == 1000
        st.kv_events(KVEvents("store", ("k1",), ()))
        rep.on_placement(["k0", "k1"], "p0", 2.0)
        await asyncio.gather(*rep._tasks)
        assert fake.calls[-1][1]["segment"] == "p1-kv"   # p1 lacks k1 again
        assert fake.calls[-1][1]["keys"] == [store_object_key("abcdef0123456789ff", "k1")]
        assert rep.used_bytes == 2000 <= cfg.hot_replication_budget_bytes
        await rep.close()

    asyncio.run(run())


def test_segment_of_an_instance() -> None:
    assert segment_of("p1", ["p0-kv", "p1-kv"]) == "p1-kv"
    assert segment_of("p1", ["p1-store"]) == "p1-store"
    assert segment_of("p1", ["p1-x", "p10-kv"]) == "p1-x"       # the only "p1-…"
    assert segment_of("p1", ["p1-x", "p1-y"]) is None             # ambiguous
    assert segment_of("p1", ["p10-kv"]) is None


def test_off_means_no_replicator() -> None:
    on = Conductor(ConductorConfig(master="127.0.0.1:1"))
    assert on.replicator is not None and on.replicator.budget_bytes == 256 << 20
    assert Conductor(ConductorConfig(master="127.0.0.1:1", hot_replication=False)
                     ).replicator is None
    assert Conductor(ConductorConfig()).replicator is None                 # no master
    assert Conductor(ConductorConfig(master="127.0.0.1:1", policy="random")
                     ).replicator is None                                  # no global Store
