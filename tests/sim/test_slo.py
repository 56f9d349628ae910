"""The paper's TBT (mean of the longest 10 % of token intervals) and SLO attainment, by hand."""

from __future__ import annotations

import pytest

from pymooncake.obs.slo import (
    meets_slo,
    percentile,
    slo_attainment,
    tbt_from_token_times_s,
    tbt_num_longest,
    tbt_s,
)


def test_rounding_is_ceil_of_a_tenth_in_integers() -> None:
    assert [tbt_num_longest(k) for k in (0, 1, 9, 10, 11, 20, 29, 30, 31)] == \
        [0, 1, 1, 1, 2, 2, 3, 3, 4]          # ceil(0.1*30) in floats would wrongly give 4


def test_tbt_by_hand() -> None:
    assert tbt_s([0.5]) == 0.5
    assert tbt_s([float(i) for i in range(1, 11)]) == 10.0              # 10 intervals: top 1
    assert tbt_s([float(i) for i in range(1, 12)]) == 10.5              # 11: (11 + 10) / 2
    ivs = [0.03] * 27 + [0.2, 0.1, 0.3]                                  # 30: top 3
    assert tbt_s(ivs) == pytest.approx((0.3 + 0.2 + 0.1) / 3)
    assert tbt_s([]) is None
    assert tbt_from_token_times_s([0.0, 0.1, 0.3, 0.35]) == pytest.approx(0.2)
    assert tbt_from_token_times_s([1.0]) is None
    with pytest.raises(ValueError):
        tbt_s([-1.0])


def test_slo_attainment() -> None:
    # served within both; TTFT too long; TBT too long; rejected; single token (no TBT).
    ttfts = [1.0, 31.0, 2.0, None, 0.5]
    tbts = [0.05, 0.05, 0.2, None, None]
    assert slo_attainment(ttfts, tbts, 30.0, 0.1) == pytest.approx(2 / 5)
    assert meets_slo(30.0, 0.1, 30.0, 0.1)


def test_percentile_matches_linear_interpolation() -> None:
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 90) == pytest.approx(4.6)      # 1 + 0.9·4 = 4.6 on sorted 1..5
    assert percentile([], 50) != percentile([], 50)      # NaN
