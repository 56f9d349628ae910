"""Hot-block replication (FAST'25 §4.2, Figure 11): which fetched block keys a prefill
instance keeps as a local replica.

When Algorithm 1 fetches a prefix from another holder, the fetched blocks are written into the
chosen instance's cache; blocks accessed often thereby gain replicas on many instances, while
cold ones stay single. ``blocks_to_replicate`` makes that choice explicit and bounded.

The live Conductor (``conductor.replication``) counts reuse over a sliding window
(``ReuseWindow``) and asks ``plan_replication`` after each placement which instance gains
which hot blocks; the Store then copies them to that instance's segment.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pymooncake.conductor.policy.types import BlockKeyLike, InstanceId


@dataclass(frozen=True, slots=True)
class HotBlockConfig:
    """When a fetched block becomes a replica."""

    min_accesses: int = 1
    """Accesses (prefix matches, this one included) a block needs before it is replicated;
    1 = keep every fetched block (the paper's proactive migration)."""
    max_replicas: int | None = None
    """Cap on holders per block (``None`` = every instance may hold one)."""

    def __post_init__(self) -> None:
        if self.min_accesses < 1:
            raise ValueError(f"min_accesses must be >= 1, got {self.min_accesses}")
        if self.max_replicas is not None and self.max_replicas < 1:
            raise ValueError(f"max_replicas must be >= 1 or None, got {self.max_replicas}")


def blocks_to_replicate(fetched: Sequence[BlockKeyLike],
                        access_count: Callable[[BlockKeyLike], int],
                        num_replicas: Callable[[BlockKeyLike], int],
                        cfg: HotBlockConfig) -> tuple[BlockKeyLike, ...]:
    """The keys among ``fetched`` to keep on the fetching instance.

    A key is kept when ``access_count(key) >= cfg.min_accesses`` and it has fewer than
    ``cfg.max_replicas`` holders. Order follows ``fetched`` (prefix order).
    """
    out = []
    cap = cfg.max_replicas
    for k in fetched:
        if access_count(k) >= cfg.min_accesses and (cap is None or num_replicas(k) < cap):
            out.append(k)
    return tuple(out)


class ReuseWindow:
    """Reuse counts of block keys over a sliding window of ``window_s`` seconds (the live
    Conductor's ``access_count`` for ``blocks_to_replicate``). State holder only: the clock
    is passed in; ``record`` and ``count`` expire what left the window."""

    __slots__ = ("_counts", "_events", "window_s")

    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._events: deque[tuple[float, tuple[BlockKeyLike, ...]]] = deque()
        self._counts: dict[BlockKeyLike, int] = {}

    def expire(self, now_s: float) -> None:
        ev, c = self._events, self._counts
        while ev and ev[0][0] <= now_s - self.window_s:
            for k in ev.popleft()[1]:
                n = c[k] - 1
                if n:
                    c[k] = n
                else:
                    del c[k]

    def record(self, keys: Sequence[BlockKeyLike], now_s: float) -> None:
        """One access of each of ``keys`` (a request reusing them) at ``now_s``."""
        self.expire(now_s)
        if keys:
            t = tuple(keys)
            self._events.append((now_s, t))
            for k in t:
                self._counts[k] = self._counts.get(k, 0) + 1

    def count(self, key: BlockKeyLike) -> int:
        """Accesses of ``key`` still inside the window (as of the last ``record``/``expire``)."""
        return self._counts.get(key, 0)

    def __len__(self) -> int:
        return len(self._counts)


def plan_replication(keys: Sequence[BlockKeyLike],
                     holders: Callable[[BlockKeyLike], frozenset[InstanceId]],
                     targets: Sequence[InstanceId],
                     access_count: Callable[[BlockKeyLike], int],
                     cfg: HotBlockConfig, max_blocks: int
                     ) -> tuple[InstanceId, tuple[BlockKeyLike, ...]] | None:
    """Which prefill instance gains replicas of which of a request's hot blocks.

    The reused blocks are the leading ``keys`` some holder has. For each of ``targets`` in
    order (the live Conductor passes the request's prefill instance first, then the
    others, least loaded first), the candidates are the reused blocks it lacks, filtered by
    ``blocks_to_replicate``; the first target with any gets them, cut at the first block
    it would still lack (a block counts for a prefix match only after every earlier one,
    DESIGN.md §3) and at ``max_blocks`` (what the byte budget allows). ``None``: nothing.
    """
    reused: list[BlockKeyLike] = []
    for k in keys:
        if not holders(k):
            break
        reused.append(k)
    if not reused or max_blocks <= 0:
        return None
    for t in targets:
        lacking = [k for k in reused if t not in holders(k)]
        if not lacking:
            continue
        chosen = set(blocks_to_replicate(lacking, access_count,
                                         lambda k: len(holders(k)), cfg))
        out: list[BlockKeyLike] = []
        for k in reused:
            if t in holders(k):
                continue
            if k not in chosen or len(out) >= max_blocks:
                break
            out.append(k)
        if out:
            return t, tuple(out)
    return None
