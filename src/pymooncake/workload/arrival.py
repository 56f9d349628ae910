"""Arrival scaling and slicing of traces (the paper replays its traces at scaled rates, §8).

Every function returns a new ``Trace``; requests keep their ``index`` (position in the source
file), ``path``, ``block_size`` and ``num_skipped`` so a slice can be traced back.
"""

from __future__ import annotations

import dataclasses
import math

from pymooncake.workload.trace import MAX_TIMESTAMP_MS, Trace, TraceRequest


def _with_requests(trace: Trace, requests: list[TraceRequest]) -> Trace:
    return dataclasses.replace(trace, requests=tuple(requests))


def scale_arrivals(trace: Trace, factor: float) -> Trace:
    """Speed a trace up (``factor > 1``) or slow it down (``factor < 1``).

    Every ``timestamp_ms`` is divided by ``factor``, so inter-arrival times shrink by it and
    the request rate grows by it; lengths and hash ids are unchanged.

    Raises ``ValueError`` unless ``factor`` is a finite number > 0.
    """
    if isinstance(factor, bool) or not isinstance(factor, int | float) \
            or not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"factor must be a finite number > 0 (2 = twice as fast), got {factor!r}")
    last_ms = max((r.timestamp_ms for r in trace.requests), default=0.0)
    if last_ms / factor > MAX_TIMESTAMP_MS:
        raise ValueError(f"factor {factor!r} stretches the last arrival ({last_ms:g} ms) past "
                         f"{MAX_TIMESTAMP_MS:.0e} ms; use a factor >= "
                         f"{last_ms / MAX_TIMESTAMP_MS:.3g}")
    return _with_requests(trace, [dataclasses.replace(r, timestamp_ms=r.timestamp_ms / factor)
                                  for r in trace.requests])


def take_window(trace: Trace, start_s: float, end_s: float, *, rebase: bool = True) -> Trace:
    """Requests arriving in ``[start_s, end_s)`` seconds from the trace start.

    With ``rebase`` (default) timestamps are shifted by ``-start_s`` so the window starts at
    time 0; otherwise they are kept as in the source. ``end_s`` may be ``math.inf``.

    Raises ``ValueError`` unless ``0 <= start_s <= end_s`` (both numbers, ``start_s`` finite).
    """
    for name, v in (("start_s", start_s), ("end_s", end_s)):
        if isinstance(v, bool) or not isinstance(v, int | float) or math.isnan(v):
            raise ValueError(f"{name} must be a number of seconds, got {v!r}")
    if not math.isfinite(start_s) or start_s < 0:
        raise ValueError(f"start_s must be finite and >= 0, got {start_s!r}")
    if end_s < start_s:
        raise ValueError(f"end_s ({end_s}) must be >= start_s ({start_s})")
    lo_ms, hi_ms = start_s * 1000.0, end_s * 1000.0
    shift = lo_ms if rebase else 0.0
    kept = [r for r in trace.requests if lo_ms <= r.timestamp_ms < hi_ms]
    return _with_requests(trace, [dataclasses.replace(r, timestamp_ms=r.timestamp_ms - shift)
                                  for r in kept] if shift else kept)


def take_first(trace: Trace, n: int) -> Trace:
    """The first ``n`` requests in arrival order (all of them if the trace is shorter).

    Raises ``ValueError`` unless ``n`` is an int >= 0.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    return _with_requests(trace, list(trace.requests[:n]))
