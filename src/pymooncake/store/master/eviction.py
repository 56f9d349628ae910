"""Eviction: high watermark + approximate LRU over the DRAM pool (pure).

Paper §3.2 / Mooncake master: a pass runs when used/capacity exceeds the high watermark
(default 0.90) or an allocation fails. A watermark pass evicts ``eviction_ratio`` (default
5%) of the objects that have an evictable memory replica (``target_count``), and at least
enough to get back under the watermark. Candidates are published, unleased, not
hard-pinned and not already moving; unpinned ones go first (least recently used first),
soft-pinned ones only in a second pass. The caller filters eligibility; this module orders and cuts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

EVICT_REASON_WATERMARK = "watermark"
EVICT_REASON_NO_SPACE = "no_space"


@dataclass(frozen=True, slots=True)
class Candidate:
    key: str
    freed_bytes: int
    last_access_ms: float
    soft_pinned: bool


def bytes_to_free(used_bytes: int, capacity_bytes: int, high_watermark_ratio: float,
                  eviction_ratio: float) -> int:
    """0 at or below the watermark; else ``eviction_ratio × capacity``, at least enough to
    get back under the watermark."""
    if capacity_bytes <= 0 or used_bytes <= high_watermark_ratio * capacity_bytes:
        return 0
    over = used_bytes - int(high_watermark_ratio * capacity_bytes)
    return max(int(eviction_ratio * capacity_bytes), over)


def order_candidates(candidates: Iterable[Candidate]) -> list[Candidate]:
    """Unpinned first, then soft-pinned; least recently used first within each pass."""
    return sorted(candidates, key=lambda c: (c.soft_pinned, c.last_access_ms, c.key))


def target_count(num_candidates: int, eviction_ratio: float) -> int:
    """Objects one watermark pass evicts at least: ``ceil(ratio × candidates)``, where the
    candidates are only objects with an evictable memory replica — never objects held only
    on SSD, leased or pinned, which a pass cannot evict (case BUG-62, Mooncake PR #2286)."""
    return math.ceil(eviction_ratio * num_candidates - 1e-9) if num_candidates else 0


def select_victims(candidates: Iterable[Candidate], need_bytes: int,
                   min_count: int = 0) -> list[str]:
    """Keys to evict, in order, until ``need_bytes`` are freed and at least ``min_count``
    keys are chosen (or candidates run out)."""
    victims: list[str] = []
    freed = 0
    for c in order_candidates(candidates):
        if freed >= need_bytes and len(victims) >= min_count:
            break
        victims.append(c.key)
        freed += c.freed_bytes
    return victims
