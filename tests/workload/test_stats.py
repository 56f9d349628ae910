"""Trace statistics and the infinite-cache prefix ratio, checked against a hand calculation
and an independent prefix-tuple implementation."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pymooncake.workload import (
    Trace,
    TraceRequest,
    load_trace,
    prefix_blocks_hit,
    prefix_hit_tokens,
    trace_stats,
)

from .conftest import req, shared_trace

# Block size 4. Hand calculation of the infinite-cache replay (hit tokens per request):
#   r0 [1,2]      in 6  : nothing seen                          -> 0
#   r1 [1,3,4]    in 10 : 1 seen, 3 not                         -> 4
#   r2 [1,3,5]    in 12 : 1,3 seen, 5 not                       -> 8
#   r3 [1,2]      in 6  : 1,2 seen; 2 blocks = 8 > 6, capped    -> 6
#   r4 [6,7]      in 5  : 6 not seen                            -> 0
#   r5 [1,3,5,8]  in 16 : 1,3,5 seen, 8 not                     -> 12
# token-weighted 30/55; request-weighted (0+.4+8/12+1+0+.75)/6; blocks hit 8 of 16.
HAND = [req(0, 6, 1, [1, 2]), req(1000, 10, 2, [1, 3, 4]), req(2000, 12, 3, [1, 3, 5]),
        req(3000, 6, 4, [1, 2]), req(4000, 5, 5, [6, 7]), req(5000, 16, 6, [1, 3, 5, 8])]


def reference_ratio(requests: list[tuple[tuple[int, ...], int]], block_size: int) -> float:
    """Independent definition: the cache is a set of whole prefixes (tuples of ids)."""
    cached: set[tuple[int, ...]] = set()
    hit = total = 0
    for ids, n in requests:
        k = 0
        while k < len(ids) and ids[: k + 1] in cached:
            k += 1
        hit += min(k * block_size, n)
        total += n
        cached.update(ids[:j] for j in range(1, len(ids) + 1))
    return hit / total


def reference_ratio_trie(trace: Trace) -> float:
    """Same definition with a trie of (parent node, id) edges: linear time for real traces."""
    edges: dict[tuple[int, int], int] = {}
    hit = total = 0
    for r in trace.requests:
        node, k, matching = 0, 0, True
        for h in r.hash_ids:
            child = edges.get((node, h))
            if child is None:
                matching = False
                child = edges[(node, h)] = len(edges) + 1
            elif matching:
                k += 1
            node = child
        hit += min(k * trace.block_size, r.input_length)
        total += r.input_length
    return hit / total


class TestHandTrace:
    def test_hand_calculated_figures(self, write_jsonl) -> None:  # noqa: ANN001
        s = trace_stats(load_trace(write_jsonl(HAND), block_size=4))
        assert s.num_requests == 6
        assert s.total_input_tokens == 55 and s.cache_hit_tokens == 30
        assert s.cache_ratio == pytest.approx(30 / 55)
        assert s.request_cache_ratio == pytest.approx((0 + 0.4 + 8 / 12 + 1 + 0 + 0.75) / 6)
        assert s.block_cache_ratio == pytest.approx(8 / 16)
        assert s.mean_input_length == pytest.approx(55 / 6)
        assert s.mean_output_length == pytest.approx(3.5)
        assert s.duration_s == 5.0 and s.request_rate_per_s == pytest.approx(1.2)
        assert s.num_unique_blocks == 8 and s.num_blocks == 16
        assert s.p50_input_length == 8.0  # median of 5,6,6,10,12,16

    def test_reference_agrees_on_hand_trace(self) -> None:
        assert reference_ratio([(tuple(r["hash_ids"]), r["input_length"]) for r in HAND], 4) \
            == pytest.approx(30 / 55)

    def test_arrival_order_not_file_order(self, write_jsonl) -> None:  # noqa: ANN001
        # file order r1, r0 but r0 arrives first: r1 then hits block 1
        t = load_trace(write_jsonl([req(10, 8, 1, [1, 3]), req(0, 8, 1, [1, 2])]), block_size=4)
        assert trace_stats(t).cache_hit_tokens == 4

    def test_to_dict_has_the_issue_keys(self, write_jsonl) -> None:  # noqa: ANN001
        d = trace_stats(load_trace(write_jsonl(HAND), block_size=4)).to_dict()
        for key in ("num_requests", "mean_input_length", "mean_output_length", "duration_s",
                    "cache_ratio", "num_skipped"):
            assert key in d


class TestPrefixHitTokens:
    @pytest.mark.parametrize("ids,n,seen,expected", [
        ((1, 2, 3), 1500, {1, 2, 3}, 1500),      # full hit incl. partial last block: capped
        ((1, 2, 3), 1536, {1, 2, 3}, 1536),
        ((1, 2, 3), 1500, {1, 2}, 1024),
        ((1, 2, 3), 1500, {2, 3}, 0),            # a hit after a miss does not count
        ((1, 2, 3), 1500, {1, 3}, 512),
        ((), 10, {1}, 0),
        ((7,), 100, {7}, 100),
    ])
    def test_rule(self, ids: tuple, n: int, seen: set, expected: int) -> None:
        assert prefix_hit_tokens(ids, n, seen, 512) == expected
        assert prefix_blocks_hit(ids, seen) * 512 >= expected

    def test_seen_not_modified_and_any_container(self) -> None:
        seen = {1: "a", 2: "b"}
        assert prefix_hit_tokens([1, 2], 600, seen.keys(), 512) == 600
        assert seen == {1: "a", 2: "b"}

    def test_stats_is_sum_of_rule(self, conversation: Trace) -> None:
        part = Trace(conversation.requests[:2000], block_size=512)
        seen: set[int] = set()
        hit = 0
        for r in part.requests:
            hit += prefix_hit_tokens(r.hash_ids, r.input_length, seen, 512)
            seen.update(r.hash_ids)
        assert trace_stats(part).cache_hit_tokens == hit


class TestRealTraceRatios:
    def test_conversation_ratio_matches_independent_trie(self, conversation: Trace) -> None:
        s = trace_stats(conversation)
        assert math.isclose(s.cache_ratio, reference_ratio_trie(conversation), rel_tol=1e-12)
        # documented in docs/workload.md (paper Table 2 lists 40%)
        assert round(s.cache_ratio, 4) == 0.3736
        assert round(s.request_cache_ratio, 4) == 0.4094

    def test_synthetic_ratio_matches_independent_trie(self) -> None:
        t = load_trace(shared_trace("synthetic"))
        s = trace_stats(t)
        assert math.isclose(s.cache_ratio, reference_ratio_trie(t), rel_tol=1e-12)
        assert round(s.cache_ratio, 4) == 0.6512  # paper Table 2 lists 66%


def test_trace_request_ints_compare_in_stats() -> None:
    t = Trace((TraceRequest(0.0, 10, 1, (1,)), TraceRequest(0.0, 10, 1, (1,), index=1)),
              block_size=8)
    s = trace_stats(t)
    assert s.cache_hit_tokens == 8 and s.duration_s == 0.0 and s.request_rate_per_s == 0.0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=6),
                          st.integers(0, 3)), min_size=1, max_size=12))
def test_ratio_equals_whole_prefix_reference_on_random_traces(
        prompts: list[tuple[list[int], int]]) -> None:
    """Random prompts of blocks; hash ids assigned like the Mooncake release (one id per
    distinct whole prefix); the last block is partial by ``cut`` tokens."""
    ids_of: dict[tuple[int, ...], int] = {}
    reqs = []
    ref_input = []
    for i, (blks, cut) in enumerate(prompts):
        ids = tuple(ids_of.setdefault(tuple(blks[:j + 1]), len(ids_of))
                    for j in range(len(blks)))
        n = 4 * len(blks) - min(cut, 3)
        reqs.append(TraceRequest(float(i), n, 1, ids, index=i))
        ref_input.append((tuple(blks), n))
    s = trace_stats(Trace(tuple(reqs), block_size=4))
    assert s.cache_ratio == pytest.approx(reference_ratio(ref_input, 4))
