"""EPLB placement and replica routing (pure functions)."""

from __future__ import annotations

from pymooncake.engine.ep import placement as pl


def test_every_expert_placed_and_hot_ones_replicated() -> None:
    load = [100, 1, 1, 1, 1, 1, 1, 50]
    plan = pl.plan_layer(8, [0, 1, 2, 3], 3, load)
    assert set(plan) == set(range(8))
    assert len(plan[0]) >= len(plan[7]) > len(plan[1])
    per_rank = [sum(r in rs for rs in plan.values()) for r in range(4)]
    assert per_rank == [3, 3, 3, 3]
    assert all(len(set(rs)) == len(rs) for rs in plan.values())  # copies on distinct ranks


def test_slots_grow_when_too_few_ranks() -> None:
    plan = pl.plan_layer(8, [0, 2, 3], 2)
    assert all(plan[e] for e in range(8))
    assert sum(len(rs) for rs in plan.values()) == 9  # ceil(8/3) = 3 slots each


def test_assign_rows_splits_over_live_copies_and_reports_missing() -> None:
    layer = {0: (0, 1), 1: (2,), 2: (3,)}
    todo, missing = pl.assign_rows(layer, [5, 2, 1], alive={0, 1, 2}, split_min=2)
    assert todo == {0: [(0, 0, 3)], 1: [(0, 3, 2)], 2: [(1, 5, 2)]}
    assert missing == [2]
    todo, _ = pl.assign_rows(layer, [5, 0, 0], alive={1})
    assert todo == {1: [(0, 0, 5)]}


def test_small_groups_go_whole_to_one_copy_balancing_replicas() -> None:
    layer = {0: (0, 1), 1: (0, 1), 2: (1, 2)}
    todo, _ = pl.assign_rows(layer, [3, 2, 4], alive={0, 1, 2})
    assert todo == {0: [(0, 0, 3)], 1: [(1, 3, 2)], 2: [(2, 5, 4)]}


def test_missing_experts_and_rank_experts() -> None:
    plan = pl.plan_placement(2, 4, [0, 1], 2)
    assert pl.missing_experts(plan, {0, 1}) == []
    lost = pl.missing_experts(plan, {0})
    assert lost == [(i, e) for i, e in pl.rank_experts(plan, 1)]
