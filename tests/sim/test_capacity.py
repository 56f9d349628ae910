"""Figure 9 trace arithmetic: hit ratio vs LRU capacity; the maximum is the cache ratio."""

from __future__ import annotations

import pytest

from pymooncake.sim.capacity import capacity_curve, hit_ratio_at
from pymooncake.workload.stats import trace_stats


def test_by_hand_small_trace(make_trace) -> None:
    # blocks of 4 tokens. r0 [1,2] 8 tok; r1 [1,2,3] 10 tok (partial last); r2 [1,2,3] 9 tok;
    # infinite: r1 hits 8, r2 hits min(12, 9) = 9 -> (8 + 9) / 27.
    t = make_trace([(0, 8, 1, (1, 2)), (1, 10, 1, (1, 2, 3)), (2, 9, 1, (1, 2, 3))], 4)
    assert hit_ratio_at(t, None) == pytest.approx(17 / 27)
    # capacity 2 blocks (8 tokens): after r1 the cache holds [2, 3] (1 evicted) -> r2 hits 0;
    # r1 hit 8 -> 8 / 27.
    assert hit_ratio_at(t, 8) == pytest.approx(8 / 27)
    assert hit_ratio_at(t, 0) == 0.0
    with pytest.raises(ValueError, match="capacity"):
        capacity_curve(t, (10, -5))


def test_max_equals_trace_stats_cache_ratio(conversation_head) -> None:  # noqa: ANN001
    c = capacity_curve(conversation_head, (10_000, 1_000_000, 10**9))
    assert c.max_hit_ratio == trace_stats(conversation_head).cache_ratio
    assert c.hit_ratio[-1] == c.max_hit_ratio
    assert list(c.hit_ratio) == sorted(c.hit_ratio)
