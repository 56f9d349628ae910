"""conductor.policy.cpp_placement: which prompts the prefill placement sends to a CPP group."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from pymooncake.conductor.cluster_view import cpp_model_of
from pymooncake.conductor.policy import (
    ClusterView,
    CppCostModel,
    DecodeInstanceState,
    Estimators,
    InstanceId,
    Placement,
    PolicyConfig,
    PrefillEstimator,
    PrefillInstanceState,
    PrefixMatch,
    RequestInfo,
    place_prefill_global_cache,
    schedule,
    use_cpp,
    with_cpp,
)
from pymooncake.conductor.policy.cpp import cpp_prefill_s
from pymooncake.conductor.policy.cpp_placement import cpp_model_from_wire, cpp_model_to_wire
from pymooncake.rpc.messages import WorkerInfo

EST = Estimators(prefill=PrefillEstimator(quadratic_s=0.0, linear_s=1e-3))
CFG = PolicyConfig(block_size_tokens=16, ttft_slo_s=1e6, early_rejection=False)
GROUP = CppCostModel(num_stages=2, chunk_tokens=64, edge_tokens=0, hop_s=0.001,
                     overhead_s=0.0, min_prompt_tokens=128)
POLICY = with_cpp(place_prefill_global_cache)


def _view(single_busy_s: float = 0.0, group_busy_s: float = 0.0, singles: int = 1
          ) -> ClusterView:
    pre = [PrefillInstanceState(InstanceId(f"p{i}"), single_busy_s) for i in range(singles)]
    pre.append(PrefillInstanceState(InstanceId("cpp"), group_busy_s, cpp=GROUP))
    return ClusterView(0.0, tuple(pre), (DecodeInstanceState(InstanceId("d"), 0, 0, 10**6,
                                                             64),))


def _req(n: int) -> RequestInfo:
    return RequestInfo("r", n, (), 4, 0.0)


def _place(n: int, view: ClusterView, match: PrefixMatch | None = None) -> Placement:
    m = match or PrefixMatch((0,) * len(view.prefill))
    p = POLICY(_req(n), view, m, EST, CFG)
    assert isinstance(p, Placement)
    return p


def test_long_prompt_to_group_short_to_single() -> None:
    view = _view()
    assert _place(400, view).prefill_instance == "cpp"
    assert _place(127, view).prefill_instance == "p0"      # under the break-even
    p = _place(400, view)
    # the group's predicted prefill is the pipeline's, from token 0: 400 / 2 + fill + hop
    assert p.predicted_prefill_s == pytest.approx(cpp_prefill_s(
        dataclasses.replace(GROUP, single=EST.prefill), 400, 0))
    assert p.predicted_prefill_s == pytest.approx(0.2 + 0.032 + 0.001)


def test_busy_group_loses_to_idle_single() -> None:
    # the group would save 0.4 - 0.233 s but its queue is 1 s long
    assert _place(400, _view(group_busy_s=1.0)).prefill_instance == "p0"
    # a busy single worker: the group wins even more clearly
    assert _place(400, _view(single_busy_s=1.0)).prefill_instance == "cpp"


def test_prefix_reused_by_single_counts_against_group() -> None:
    """The single worker holds 300 of 400 tokens: 100 uncached < 128, no CPP (the group
    would recompute all 400)."""
    match = PrefixMatch((300 // 16, 0), 300 // 16, InstanceId("p0"))
    assert _place(400, _view(), match).prefill_instance == "p0"
    # the same decision as the pure use_cpp on the uncached part
    assert not use_cpp(400, 288, dataclasses.replace(GROUP, single=EST.prefill))


def test_group_alone_takes_every_prompt() -> None:
    view = _view(singles=0)
    assert _place(10, view).prefill_instance == "cpp"
    assert _place(400, view).prefill_instance == "cpp"


def test_without_group_base_policy_unchanged_and_schedule_places_decode() -> None:
    view = ClusterView(0.0, (PrefillInstanceState(InstanceId("p0"), 0.0),), ())
    m = PrefixMatch((0,))
    assert POLICY(_req(400), view, m, EST, CFG) == place_prefill_global_cache(
        _req(400), view, m, EST, CFG)
    p = schedule(_req(400), _view(), PrefixMatch((0, 0)), EST, CFG, POLICY)
    assert isinstance(p, Placement)
    assert (p.prefill_instance, p.decode_instance) == ("cpp", "d")


def test_cost_model_wire_round_trip_and_bad_input() -> None:
    assert cpp_model_from_wire(cpp_model_to_wire(GROUP)) == GROUP
    info = WorkerInfo("c", "prefill", "h", 1, "{}", 16, 100, 4, cpp_json="")
    assert cpp_model_of(info) is None
    with pytest.raises(ValueError, match="lacks"):
        cpp_model_of(msgspec.structs.replace(info, cpp_json='{"num_stages": 2}'))
    with pytest.raises(ValueError, match="not JSON"):
        cpp_model_of(msgspec.structs.replace(info, cpp_json="{"))
    bad = dict(cpp_model_to_wire(GROUP), num_stages=0)
    with pytest.raises(ValueError, match="num_stages"):
        cpp_model_from_wire(bad)


def test_unhealthy_group_is_placed_as_a_single_worker() -> None:
    """A CPP instance whose load report says a stage failed (``cpp_state_json``) loses its
    cost model in the view (placed as a single worker) until a report says healthy."""
    import json

    from pymooncake.conductor.cluster_view import ClusterState
    from pymooncake.conductor.config import ConductorConfig
    from pymooncake.rpc.messages import WorkerLoad
    st = ClusterState(ConductorConfig())
    info = WorkerInfo("cpp", "prefill", "127.0.0.1", 1, "{}", 16, 4096, 8,
                      cpp_json=json.dumps(cpp_model_to_wire(GROUP)))
    st.register(info, 0.0)

    def report(healthy: bool, reason: str = "") -> CppCostModel | None:
        state = json.dumps({"healthy": healthy, "reason": reason, "stages": []})
        assert st.report(WorkerLoad("cpp", 0, 0, 10, 10, cpp_state_json=state), 1.0)
        (inst,) = st.view(1.0).prefill
        return inst.cpp

    assert report(True) == GROUP
    assert report(False, "CPP stage 1 (127.0.0.1:9) exited (status -9)") is None
    assert st.workers["cpp"].cpp_state["reason"].startswith("CPP stage 1")
    assert report(True) == GROUP
    # a report the Conductor cannot read changes nothing
    assert st.report(WorkerLoad("cpp", 0, 0, 10, 10, cpp_state_json="{"), 1.0)
    assert st.view(1.0).prefill[0].cpp == GROUP
