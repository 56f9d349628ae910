"""Arrival scaling, time windows and the first N requests."""

from __future__ import annotations

import math

import pytest

from pymooncake.workload import (
    Trace,
    TraceRequest,
    scale_arrivals,
    take_first,
    take_window,
    trace_stats,
)


def small() -> Trace:
    return Trace(tuple(TraceRequest(float(t), 100, 1, (i,), index=i)
                       for i, t in enumerate([0, 500, 1000, 2500, 4000])),
                 path="x.jsonl", num_skipped=2, block_size=64)


def test_scale_arrivals_faster_and_slower() -> None:
    t = small()
    fast = scale_arrivals(t, 2.0)
    assert [r.timestamp_ms for r in fast] == [0, 250, 500, 1250, 2000]
    assert trace_stats(fast).request_rate_per_s == pytest.approx(
        2 * trace_stats(t).request_rate_per_s)
    slow = scale_arrivals(t, 0.5)
    assert [r.timestamp_ms for r in slow] == [0, 1000, 2000, 5000, 8000]
    assert (fast.path, fast.num_skipped, fast.block_size) == ("x.jsonl", 2, 64)
    assert [r.hash_ids for r in fast] == [r.hash_ids for r in t]


@pytest.mark.parametrize("factor", [0, -1, math.inf, math.nan, "2", True])
def test_scale_arrivals_bad_factor(factor: object) -> None:
    with pytest.raises(ValueError, match="factor"):
        scale_arrivals(small(), factor)  # type: ignore[arg-type]


def test_take_window_rebased_and_absolute() -> None:
    w = take_window(small(), 0.5, 2.5)
    assert [r.index for r in w] == [1, 2]  # [0.5 s, 2.5 s): 2500 ms excluded
    assert [r.timestamp_ms for r in w] == [0, 500]
    a = take_window(small(), 0.5, 2.5, rebase=False)
    assert [r.timestamp_ms for r in a] == [500, 1000]
    assert len(take_window(small(), 0, math.inf)) == 5
    assert len(take_window(small(), 5, 5)) == 0


@pytest.mark.parametrize("start,end,match", [
    (-1, 2, "start_s"), (3, 2, "end_s"), (math.inf, math.inf, "start_s"),
    (math.nan, 1, "start_s"), ("0", 1, "start_s"),
])
def test_take_window_bad(start: object, end: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        take_window(small(), start, end)  # type: ignore[arg-type]


def test_take_first() -> None:
    assert [r.index for r in take_first(small(), 2)] == [0, 1]
    assert len(take_first(small(), 0)) == 0 and len(take_first(small(), 99)) == 5
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="n must be"):
            take_first(small(), bad)  # type: ignore[arg-type]
