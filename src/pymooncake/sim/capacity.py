"""Hit ratio vs cache capacity for one global LRU cache in arrival order (FAST'25 §5.3.1,
Figure 9): trace arithmetic only, no timing, no hot-spot replication.

Per request the hit is ``workload.stats.prefix_hit_tokens`` (the same function — and so the
same partial-block rule — as ``trace_stats``' cache ratio) against the blocks the cache holds
at its arrival; then its blocks are used (LRU order), costing ``block_size`` tokens each. With
a capacity at least the trace's distinct blocks nothing is evicted and the curve's end equals
``trace_stats(trace).cache_ratio`` exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pymooncake.sim.cache_model import LruBlockCache
from pymooncake.workload.stats import prefix_hit_tokens
from pymooncake.workload.trace import Trace

DEFAULT_CAPACITIES_TOKENS: tuple[int, ...] = (
    10_000, 100_000, 1_000_000, 2_000_000, 3_000_000, 4_000_000, 5_000_000, 8_000_000,
    10_000_000, 30_000_000, 50_000_000, 100_000_000, 500_000_000, 1_000_000_000)
"""The paper's Figure 9 vertices plus 3M (one node's DRAM) and 30M (ten nodes')."""


@dataclass(frozen=True, slots=True)
class CapacityCurve:
    capacities_tokens: tuple[int, ...]
    hit_ratio: tuple[float, ...]
    """Token-weighted hit ratio at each capacity (same order)."""
    max_hit_ratio: float
    """Infinite cache: equals ``trace_stats(trace).cache_ratio``."""


def hit_ratio_at(trace: Trace, capacity_tokens: int | None) -> float:
    """Token-weighted hit ratio of one LRU cache of ``capacity_tokens`` (``None`` = infinite)."""
    bs = trace.block_size
    reqs = trace.requests
    total = sum(r.input_length for r in reqs)
    if total == 0:
        return 0.0
    hit = 0
    if capacity_tokens is None:
        seen: set[int] = set()
        for r in reqs:
            hit += prefix_hit_tokens(r.hash_ids, r.input_length, seen, bs)
            seen.update(r.hash_ids)
        return hit / total
    if capacity_tokens < 0:
        raise ValueError(f"capacity must be >= 0 tokens, got {capacity_tokens}")
    cache = LruBlockCache("global", capacity_tokens, bs)
    for r in reqs:
        hit += prefix_hit_tokens(r.hash_ids, r.input_length, cache, bs)
        cache.touch(r.hash_ids)
    return hit / total


def capacity_curve(trace: Trace,
                   capacities_tokens: Sequence[int] = DEFAULT_CAPACITIES_TOKENS) -> CapacityCurve:
    """Figure 9 for ``trace``; raises ``ValueError`` for a negative capacity (before running)."""
    for c in capacities_tokens:
        if c < 0:
            raise ValueError(f"capacity must be >= 0 tokens, got {c}")
    caps = tuple(int(c) for c in capacities_tokens)
    return CapacityCurve(caps, tuple(hit_ratio_at(trace, c) for c in caps),
                         hit_ratio_at(trace, None))
