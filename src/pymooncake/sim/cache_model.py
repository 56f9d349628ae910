"""Per-node KV cache with a capacity in tokens and LRU eviction over blocks (FAST'25 §3.2.1),
emitting insert/evict KV events into the policy's ``PrefixIndex``."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

from pymooncake.conductor.policy import PrefixIndex


class LruBlockCache:
    """Blocks of ``block_size`` tokens each, at most ``capacity_tokens // block_size`` of them.

    A block's cost is the full ``block_size`` (a partial last block occupies a whole block,
    as in a paged store). Blocks touched by the running request are the most recently used,
    so they are evicted last ("a block in use is never evicted" holds unless a single prompt
    exceeds the capacity). ``__contains__`` makes it a ``seen`` container for
    ``workload.stats.prefix_hit_tokens``.
    """

    __slots__ = ("holder", "capacity_blocks", "_blocks", "_index", "num_evicted")

    def __init__(self, holder: str, capacity_tokens: int, block_size: int,
                 index: PrefixIndex | None = None) -> None:
        if capacity_tokens < 0:
            raise ValueError(f"cache capacity must be >= 0 tokens, got {capacity_tokens}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.holder = holder
        self.capacity_blocks = capacity_tokens // block_size
        self._blocks: OrderedDict[Hashable, None] = OrderedDict()
        self._index = index
        self.num_evicted = 0

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def touch(self, keys: Iterable[Hashable]) -> None:
        """Use ``keys`` (in prefix order): hits move to most-recent, misses are inserted,
        then least-recently-used blocks are evicted down to the capacity."""
        if self.capacity_blocks == 0:
            return
        blocks = self._blocks
        new = []
        for k in keys:
            if k in blocks:
                blocks.move_to_end(k)
            else:
                blocks[k] = None
                new.append(k)
        if new and self._index is not None:
            self._index.insert(self.holder, new)
        over = len(blocks) - self.capacity_blocks
        if over > 0:
            gone = [blocks.popitem(last=False)[0] for _ in range(over)]
            self.num_evicted += over
            if self._index is not None:
                self._index.evict(self.holder, gone)
