"""TTFT, TBT and SLO attainment as Mooncake FAST'25 §5.1 defines them; shared by the
simulator's report and the live replay/metrics so both compute the same numbers.

* **TTFT**: first-token time − arrival time (seconds).
* **TBT** of one request: the mean of the longest 10 % of its token arrival intervals. With
  ``k`` intervals (``k`` = output tokens − 1) the longest ``m = ceil(k / 10)`` are averaged,
  computed in integers as ``m = (k + 9) // 10`` (so 10 → 1, 11 → 2, 30 → 3; a float
  ``ceil(0.1 * 30)`` would give 4). A request with fewer than 2 tokens has no interval and
  no TBT (``None``); it meets every TBT objective.
* **Effective request / SLO attainment**: the share of requests whose TTFT and TBT are both
  within their thresholds (rejected requests count as not meeting them).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def tbt_num_longest(num_intervals: int) -> int:
    """How many of ``num_intervals`` intervals the TBT averages: ``ceil(k / 10)``, exactly."""
    if num_intervals < 0:
        raise ValueError(f"num_intervals must be >= 0, got {num_intervals}")
    return (num_intervals + 9) // 10


def tbt_s(intervals_s: Sequence[float]) -> float | None:
    """The paper's TBT: mean of the longest ``ceil(k/10)`` of ``k`` token intervals (seconds).

    Returns ``None`` for no interval. Raises ``ValueError`` for a negative interval.
    """
    k = len(intervals_s)
    if k == 0:
        return None
    top = sorted(intervals_s, reverse=True)[:tbt_num_longest(k)]
    if top[-1] < 0:
        raise ValueError("token intervals must be >= 0 seconds")
    return math.fsum(top) / len(top)


def tbt_from_token_times_s(token_times_s: Sequence[float]) -> float | None:
    """TBT from the arrival times of a request's tokens (first token included)."""
    return tbt_s([b - a for a, b in zip(token_times_s, token_times_s[1:], strict=False)])


def ttft_s(arrival_s: float, first_token_s: float) -> float:
    """Time to first token (seconds); raises ``ValueError`` if the token precedes arrival."""
    if first_token_s < arrival_s:
        raise ValueError(f"first token at {first_token_s} s precedes arrival at {arrival_s} s")
    return first_token_s - arrival_s


def meets_slo(ttft: float | None, tbt: float | None, ttft_slo_s: float,
              tbt_slo_s: float) -> bool:
    """True when the request was served (``ttft`` not ``None``) within both objectives."""
    if ttft is None or ttft > ttft_slo_s:
        return False
    return tbt is None or tbt <= tbt_slo_s


def slo_attainment(ttfts: Iterable[float | None], tbts: Iterable[float | None],
                   ttft_slo_s: float, tbt_slo_s: float) -> float:
    """Share of requests meeting both objectives (the paper's effective request capacity).

    ``ttfts``/``tbts`` are aligned per request; ``None`` TTFT = rejected/failed. 0.0 for none.
    """
    n = ok = 0
    for a, b in zip(ttfts, tbts, strict=True):
        n += 1
        ok += meets_slo(a, b, ttft_slo_s, tbt_slo_s)
    return ok / n if n else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default method) of ``values``; ``q`` in [0, 100].

    Returns NaN for no values.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q}")
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
