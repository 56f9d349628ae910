"""Sweeps for cluster sizing: request rate (trace time-scale), P:D ratio, cache capacity or
network bandwidth; finds the highest rate meeting the SLOs and the P:D split that maximises
goodput for a node budget (FAST'25 §5.5, Figure 15)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pymooncake.sim.config import SimConfig
from pymooncake.sim.report import summarize
from pymooncake.sim.runner import simulate
from pymooncake.workload.arrival import scale_arrivals
from pymooncake.workload.trace import Trace

SWEEP_AXES = ("rate", "pd-ratio", "capacity", "bandwidth")
"""rate: trace time-scale factors (2 = twice the request rate); pd-ratio: prefill node counts
out of ``num_prefill + num_decode``; capacity: cache tokens per node; bandwidth: Gbps."""


@dataclass(frozen=True, slots=True)
class SweepPoint:
    value: float
    config: SimConfig
    summary: dict[str, Any]
    goodput_per_s: float
    """Requests per second that met both SLOs (over the trace's arrival span)."""


def _point_config(base: SimConfig, axis: str, v: float, total_nodes: int) -> SimConfig:
    if axis == "pd-ratio":
        p = int(v)
        if not 1 <= p < total_nodes:
            raise ValueError(f"pd-ratio value {v}: prefill nodes must be in [1, {total_nodes - 1}]")
        return dataclasses.replace(base, num_prefill=p, num_decode=total_nodes - p)
    if axis == "capacity":
        return dataclasses.replace(base, cache_capacity_tokens=int(v))
    if axis == "bandwidth":
        return dataclasses.replace(base, network_bandwidth_gbps=float(v))
    return base


def sweep(trace: Trace, base: SimConfig, axis: str, values: Sequence[float],
          progress: Callable[[int, int], None] | None = None) -> list[SweepPoint]:
    """Run ``base`` once per value of ``axis``; configs are validated before the first run.

    Raises ``ValueError`` for an unknown axis or a bad value (before anything runs).
    """
    if axis not in SWEEP_AXES:
        raise ValueError(f"unknown sweep axis {axis!r}; use one of {SWEEP_AXES}")
    if not values:
        raise ValueError("give at least one sweep value")
    total = base.num_prefill + base.num_decode
    if axis == "rate" and any(v <= 0 for v in values):
        raise ValueError("rate factors must be > 0")
    cfgs = [_point_config(base, axis, v, total) for v in values]
    span_s = ((trace.requests[-1].timestamp_ms - trace.requests[0].timestamp_ms) / 1000.0
              if trace.requests else 0.0)
    out = []
    for i, (v, cfg) in enumerate(zip(values, cfgs, strict=True)):
        t = scale_arrivals(trace, float(v)) if axis == "rate" else trace
        s = summarize(simulate(t, cfg))
        span = span_s / v if axis == "rate" else span_s
        good = s["slo_attainment"] * s["num_requests"] / span if span > 0 else 0.0
        s.pop("hot_key_replicas", None)
        out.append(SweepPoint(float(v), cfg, s, good))
        if progress is not None:
            progress(i + 1, len(values))
    return out


def best_point(points: Sequence[SweepPoint], axis: str,
               target_attainment: float) -> SweepPoint | None:
    """rate: the largest factor whose SLO attainment >= target; otherwise the max goodput."""
    if axis == "rate":
        ok = [p for p in points if p.summary["slo_attainment"] >= target_attainment]
        return max(ok, key=lambda p: p.value) if ok else None
    return max(points, key=lambda p: (p.goodput_per_s, -p.value)) if points else None
