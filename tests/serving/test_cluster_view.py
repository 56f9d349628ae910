"""The live Conductor's pure parts: ``ClusterState`` → ``policy.ClusterView`` and KV events
→ ``PrefixIndex`` (no sockets; the clock is passed in)."""

from __future__ import annotations

import pytest

from pymooncake.conductor.cluster_view import ClusterState
from pymooncake.conductor.config import ConductorConfig
from pymooncake.rpc.messages import KVEvents, WorkerInfo, WorkerLoad


def _info(iid: str, role: str) -> WorkerInfo:
    return WorkerInfo(iid, role, "127.0.0.1", 1, "{}", 16, 16 * 100, 8)


def test_view_reflects_placements_at_the_time_asked():
    st = ClusterState(ConductorConfig(prefill_concurrency_limit=4))
    for iid, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")):
        st.register(_info(iid, role), 0.0)
    p0 = st.workers["p0"]
    p0.prefills["a"] = (10.0, 2.0)      # dispatched at 10 s, predicted 2 s
    p0.prefills["b"] = (10.5, 3.0)      # queued behind it
    st.workers["d0"].decodes["x"] = (300, 20.0)
    v = st.view(11.0)
    assert [p.instance_id for p in v.prefill] == ["p0", "p1"]
    a, b = v.prefill
    assert (a.busy_until_s, a.queued_prefill_s, a.num_in_flight, a.concurrency_limit) == \
        (12.0, 3.0, 2, 4)
    assert (b.busy_until_s, b.queued_prefill_s, b.num_in_flight) == (11.0, 0.0, 0)
    (d,) = v.decode
    assert (d.num_running, d.num_context_tokens, d.kv_capacity_tokens, d.max_batch_size,
            d.finish_s) == (1, 300, 1600, 8, (20.0,))
    # the view is built fresh: a finished placement is gone from the next one (BUG-51)
    del p0.prefills["a"], p0.prefills["b"]
    assert st.view(11.0).prefill[0].num_in_flight == 0


def test_colocated_pool_and_expiry():
    st = ClusterState(ConductorConfig(colocated=True, worker_timeout_s=3.0))
    st.register(_info("c0", "colocated"), 0.0)
    st.register(_info("c1", "colocated"), 0.0)
    assert st.report(WorkerLoad("c0", 0, 0, 10, 10), 2.5)
    assert not st.report(WorkerLoad("zz", 0, 0, 10, 10), 2.5)
    v = st.view(3.0)
    assert [p.instance_id for p in v.prefill] == ["c0", "c1"] and v.decode == ()
    gone = st.expire(4.0)                 # c1 silent for 4 s > 3 s
    assert [w.info.instance_id for w in gone] == ["c1"]
    assert [p.instance_id for p in st.view(4.0).prefill] == ["c0"]


def test_kv_events_feed_the_prefix_index_and_leave_with_the_worker():
    st = ClusterState(ConductorConfig())
    st.register(_info("p0", "prefill"), 0.0)
    st.register(_info("p1", "prefill"), 0.0)
    st.kv_events(KVEvents("p0", ("k1", "k2", "k3")))
    st.kv_events(KVEvents("store", ("k1", "k2")))
    st.kv_events(KVEvents("p1", ("k1",)))
    st.kv_events(KVEvents("p0", removed=("k3",)))
    st.kv_events(KVEvents("ghost", ("k1",)))    # unregistered worker: ignored
    m = st.index.match(["k1", "k2", "k3"], ["p0", "p1"])
    assert m.local_blocks == (2, 1) and m.best_blocks == 2 and m.best_holder == "p0"
    st.remove("p0")
    m = st.index.match(["k1", "k2", "k3"], ["p1"])
    assert m.local_blocks == (1,) and (m.best_blocks, m.best_holder) == (2, "store")
    assert st.index.holders("k1") == frozenset({"p1", "store"})


def test_config_errors_say_what_to_change():
    with pytest.raises(ValueError, match="policy must be one of"):
        ConductorConfig(policy="fastest")
    with pytest.raises(ValueError, match="> 0 seconds"):
        ConductorConfig(ttft_slo_s=0)
    assert ConductorConfig().use_store and not ConductorConfig(policy="random").use_store
    assert ConductorConfig(policy="random", global_store=True).use_store
    assert not ConductorConfig(colocated=True).use_store


def _namespace_json() -> str:
    import json
    from dataclasses import asdict

    from pymooncake.identity import CacheNamespace
    ns = CacheNamespace(model_id="m", weight_revision="r", tokenizer_fingerprint="t",
                        kv_dtype="float32", kv_layout="test", block_size=16)
    return json.dumps(asdict(ns))


def test_bug_51_live_conductor_sheds_sheddable_requests_only_while_saturated():
    """One prefill instance with a concurrency limit of 4 (BUG-51 step 2 at the Conductor):
    once 4 requests are placed on it, a sheddable (priority > 0) request is refused as
    ``saturated`` and a high-priority one is still placed; drained, both are placed."""
    import asyncio

    from pymooncake.conductor.policy import Placement, Rejection
    from pymooncake.conductor.service import Conductor
    from pymooncake.rpc.messages import GenerateRequest, SamplingOptions

    async def run() -> None:
        c = Conductor(ConductorConfig(prefill_concurrency_limit=4, ttft_slo_s=1e6,
                                      tbt_slo_s=1e6))
        for iid, role in (("p0", "prefill"), ("d0", "decode")):
            info = WorkerInfo(iid, role, "127.0.0.1", 1, _namespace_json(), 16, 1 << 20, 64)
            await c._register(info)

        def req(rid: str, priority: int) -> GenerateRequest:
            return GenerateRequest(rid, tuple(range(40)), SamplingOptions(max_tokens=4),
                                   priority=priority)

        p0 = c.state.workers["p0"]
        for i in range(4):
            p0.prefills[f"long-{i}"] = (0.0, 5.0)
        assert c.state.view(1.0).prefill[0].num_in_flight == 4
        shed = c.place(req("low", 1), 1.0)
        assert isinstance(shed, Rejection) and shed.reason == "saturated"
        high = c.place(req("high", 0), 1.0)
        assert isinstance(high, Placement) and high.prefill_instance == "p0"
        assert high.decode_instance == "d0"
        p0.prefills.clear()                       # drained
        assert isinstance(c.place(req("low2", 1), 2.0), Placement)
        for w in c.state.workers.values():
            await w.client.close()

    asyncio.run(run())


def test_a_prefix_still_being_computed_counts_as_held_where_it_is_computed():
    """Request ``a`` (1,024 tokens) is placed on p0 and not finished; ``b`` shares its first
    60 blocks of 16 tokens. Hand arithmetic with the config's estimator t = 5e-8·(n²−p²) +
    1e-4·(n−p) + 3e-3: on idle p1, b computes all 1,024 tokens, 0.1555 s; on p0 it waits
    for a's remaining 0.04 s and computes 64 tokens, 5e-8·(1,024² − 960²) + 1e-4·64 + 3e-3
    = 0.01594 s: 0.05594 s, so p0 with 60 reused blocks. Once a's prefill is over and no
    KV event has said so yet, nothing is pending any more: nothing reused (both idle, the
    first instance), 0.1555 s."""
    import asyncio

    from pymooncake.conductor.policy import Placement
    from pymooncake.conductor.service import Conductor
    from pymooncake.rpc.messages import GenerateRequest, SamplingOptions

    async def run() -> None:
        c = Conductor(ConductorConfig(ttft_slo_s=1e6, tbt_slo_s=1e6, policy="local-cache"))
        for iid, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")):
            info = WorkerInfo(iid, role, "127.0.0.1", 1, _namespace_json(), 16, 1 << 20, 64)
            await c._register(info)
        a = GenerateRequest("a", tuple(range(1024)), SamplingOptions(max_tokens=4))
        b = GenerateRequest("b", tuple(range(960)) + tuple(range(5000, 5064)),
                            SamplingOptions(max_tokens=4))
        p0 = c.state.workers["p0"]
        p0.prefills["a"] = (0.0, 0.05)
        p0.prefill_keys["a"] = tuple(c.block_keys_of(a))
        assert c.state.pending_blocks(c.block_keys_of(b), ["p0", "p1"]) == (60, 0)
        got = c.place(b, 0.01)
        assert isinstance(got, Placement)
        assert (got.prefill_instance, got.prefix_blocks) == ("p0", 60)
        assert got.predicted_prefill_s == pytest.approx(
            5e-8 * (1024 ** 2 - 960 ** 2) + 1e-4 * 64 + 3e-3)
        assert got.predicted_ttft_s == pytest.approx(0.04 + got.predicted_prefill_s)
        c._prefilled("a", p0)
        assert not p0.prefills and not p0.prefill_keys
        again = c.place(b, 0.02)
        assert isinstance(again, Placement)
        assert (again.prefill_instance, again.prefix_blocks) == ("p0", 0)
        assert again.predicted_prefill_s == pytest.approx(5e-8 * 1024 ** 2 + 1e-4 * 1024 + 3e-3)
        for w in c.state.workers.values():
            await w.client.close()

    asyncio.run(run())
