"""Admission and early rejection, including CASES.md BUG-51 (stale saturation signal)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from pymooncake.conductor.policy import (
    PREFILL_POLICIES,
    ClusterView,
    DecodeEstimator,
    DecodeInstanceState,
    Estimators,
    InstanceId,
    Placement,
    PolicyConfig,
    PrefillEstimator,
    PrefillInstanceState,
    PrefixMatch,
    Rejection,
    RequestInfo,
    TransferEstimator,
    saturation,
    schedule,
)

EST = Estimators(PrefillEstimator(0.0, 1e-4, 0.0), TransferEstimator(1000, 1e9, 0.0),
                 DecodeEstimator(0.01, 0.02, 1e-8, 0.0))
DEC = (DecodeInstanceState(InstanceId("d0"), 0, 0, 10**7, 256),)


def _view(in_flight: int, busy_until_s: float = 0.0, limit: int | None = 4) -> ClusterView:
    """Built fresh from the current state for every decision (the BUG-51 fix)."""
    return ClusterView(0.0, (PrefillInstanceState(InstanceId("w0"), busy_until_s, 0.0,
                                                  in_flight, limit),), DEC)


def test_bug_51_stale_saturation_signal_never_disables_early_rejection() -> None:
    cfg = PolicyConfig(ttft_slo_s=1.0)
    pol = PREFILL_POLICIES["local-cache"]
    # Step 2: one worker, concurrency limit 4; 10 long sheddable requests + 1 high priority.
    in_flight = 0
    outcomes = []
    for i in range(10):
        req = RequestInfo(f"low{i}", 4000, (), 100, 0.0, sequence_number=i, sheddable=True)
        out = schedule(req, _view(in_flight), PrefixMatch((0,)), EST, cfg, pol)
        outcomes.append(out)
        if isinstance(out, Placement):
            in_flight += 1
        if in_flight >= 4:
            assert saturation(_view(in_flight)) >= 1.0
    assert [isinstance(o, Placement) for o in outcomes] == [True] * 4 + [False] * 6
    assert {o.reason for o in outcomes[4:] if isinstance(o, Rejection)} == {"saturated"}
    assert all(o.retry_after_s > 0 for o in outcomes[4:] if isinstance(o, Rejection))
    high = RequestInfo("high", 4000, (), 100, 0.0, sequence_number=10)
    assert isinstance(schedule(high, _view(in_flight), PrefixMatch((0,)), EST, cfg, pol),
                      Placement)
    # Step 3: TTFT objective 1 s; queued work + uncached prefill exceeds it on every worker:
    # queue 0.8 s + 4000 tokens · 0.1 ms = 1.2 s > 1 s -> rejected before any prefill runs.
    big = RequestInfo("big", 4000, (), 100, 0.0, sequence_number=11)
    out = schedule(big, _view(1, busy_until_s=0.8, limit=None), PrefixMatch((0,)), EST, cfg, pol)
    assert isinstance(out, Rejection) and out.reason == "ttft_slo"
    assert out.predicted_ttft_s == pytest.approx(1.2)
    # Step 4: drained -> saturation back to 0 and the sheddable request is admitted again.
    assert saturation(_view(0)) == 0.0
    low = replace(big, request_id="low-again", sheddable=True, num_prompt_tokens=1000)
    assert isinstance(schedule(low, _view(0), PrefixMatch((0,)), EST, cfg, pol), Placement)


def test_saturation_is_min_over_limited_instances() -> None:
    view = ClusterView(0.0, (PrefillInstanceState(InstanceId("a"), 0.0, 0.0, 4, 4),
                             PrefillInstanceState(InstanceId("b"), 0.0, 0.0, 1, 4),
                             PrefillInstanceState(InstanceId("c"), 0.0, 0.0, 9, None)), ())
    assert saturation(view) == 0.25
    assert saturation(ClusterView(0.0, (), ())) == 0.0


def test_early_rejection_off_admits_over_slo() -> None:
    big = RequestInfo("big", 40_000, (), 100, 0.0)    # 4 s of prefill > 1 s
    pol = PREFILL_POLICIES["load"]
    out = schedule(big, _view(0, limit=None), PrefixMatch((0,)), EST,
                   PolicyConfig(ttft_slo_s=1.0, early_rejection=False), pol)
    assert isinstance(out, Placement) and out.decode_instance == "d0"
    out = schedule(big, _view(0, limit=None), PrefixMatch((0,)), EST,
                   PolicyConfig(ttft_slo_s=1.0, early_rejection=True), pol)
    assert isinstance(out, Rejection) and out.retry_after_s == pytest.approx(3.0)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(ttft_slo_s=math.nan), "ttft_slo_s must be a finite number > 0"),
    (dict(ttft_slo_s=0.0), "ttft_slo_s must be a finite number > 0"),
    (dict(tbt_slo_s=math.inf), "tbt_slo_s must be a finite number > 0"),
    (dict(kvcache_balancing_threshold=math.nan), "kvcache_balancing_threshold"),
    (dict(kvcache_balancing_threshold=-1.0), "kvcache_balancing_threshold"),
])
def test_policy_config_refuses_nan_and_non_positive(kwargs, match) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=match):
        PolicyConfig(**kwargs)


def test_concurrency_limit_zero_is_refused_none_is_unlimited() -> None:
    with pytest.raises(ValueError, match="concurrency_limit must be >= 1"):
        PrefillInstanceState(InstanceId("p0"), 0.0, num_in_flight=3, concurrency_limit=0)
    unlimited = PrefillInstanceState(InstanceId("p0"), 0.0, num_in_flight=3)
    one = PrefillInstanceState(InstanceId("p1"), 0.0, num_in_flight=3, concurrency_limit=1)
    assert saturation(ClusterView(0.0, (unlimited,), ())) == 0.0
    assert saturation(ClusterView(0.0, (unlimited, one), ())) == 3.0
