"""Hot-block replication (FAST'25 §4.2, Figure 11): which fetched block keys a prefill
instance keeps as a local replica.

When Algorithm 1 fetches a prefix from another holder, the fetched blocks are written into the
chosen instance's cache; blocks accessed often thereby gain replicas on many instances, while
cold ones stay single. ``blocks_to_replicate`` makes that choice explicit and bounded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pymooncake.conductor.policy.types import BlockKeyLike


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
