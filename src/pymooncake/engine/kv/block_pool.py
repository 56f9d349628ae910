"""KV block pool: blocks, LRU free queue, block key → block map, KV events. No torch.

The local prefix cache of DESIGN.md §6 (vLLM's prefix caching, nano-vllm's block manager):
a block that is full and computed is registered under its chained ``identity`` block key;
freed blocks keep their key and contents and go to the tail of an LRU free queue, so a later
request with the same prefix reuses them copy-free until allocation pops them from the head.

Each registered block also keeps the token ids it holds, and a lookup compares them: a key
collision (CASES BUG-07) is a miss, never another prompt's KV.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pymooncake.identity import BlockKey


@dataclass(slots=True)
class KVBlock:
    """One fixed-size KV block (``block_size`` tokens, all layers). A mutable state holder."""

    block_id: int
    ref_cnt: int = 0
    """Requests whose block table holds this block."""
    block_key: BlockKey | None = None
    """Key under which it is registered in the prefix cache, or ``None``."""
    token_ids: tuple[int, ...] | None = None
    """The block's tokens while registered (compared on a hit: BUG-07)."""
    is_computed: bool = False
    """Its KV holds final values for a full block; loads never write into it (BUG-10)."""

    def reset(self) -> None:
        self.block_key = None
        self.token_ids = None
        self.is_computed = False


@dataclass(frozen=True, slots=True)
class BlockStored:
    """KV event: blocks were registered in the local prefix cache (in chain order)."""

    block_keys: tuple[BlockKey, ...]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """KV event: blocks left the local prefix cache (their memory was reused)."""

    block_keys: tuple[BlockKey, ...]


KVEvent = BlockStored | BlockRemoved


def _block_id(block: KVBlock) -> int:
    return block.block_id


class BlockPool:
    """``num_blocks`` blocks; allocation pops the least recently freed block first.

    Raises ``ValueError`` for a non-positive ``num_blocks``.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockKey, KVBlock] = {}
        self._events: list[KVEvent] = []
        self.num_collisions = 0
        """Lookups whose key matched a block holding different tokens (BUG-07)."""

    # -- queries -----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference (free, possibly still cached)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def cached_keys(self) -> list[BlockKey]:
        return list(self._cached)

    def get_cached_block(self, key: BlockKey, token_ids: Sequence[int]) -> KVBlock | None:
        """The block registered under ``key`` if it holds exactly ``token_ids``, else None."""
        block = self._cached.get(key)
        if block is None:
            return None
        if block.token_ids != tuple(token_ids):
            self.num_collisions += 1
            return None
        return block

    def holds(self, key: BlockKey, token_ids: Sequence[int]) -> bool:
        """Whether ``get_cached_block`` would return a block (no collision counted)."""
        block = self._cached.get(key)
        return block is not None and block.token_ids == tuple(token_ids)

    # -- mutations ---------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Pop ``num_blocks`` free blocks (LRU first), evicting their keys; ref_cnt = 1.

        The blocks come back in ascending ``block_id`` order: which ones are taken is the
        LRU's choice, the order among them is free, and ascending ids make a request's
        blocks consecutive runs again after a request's blocks were freed tail first
        (``free_blocks``) — a run is one transfer request per KV plane where each block
        would be one (``kv_sender``, the Store's ``block_regions``).

        Raises ``ValueError`` if fewer are free (callers check ``num_free_blocks`` first).
        """
        if num_blocks > len(self._free):
            raise ValueError(f"cannot allocate {num_blocks} blocks, {len(self._free)} free")
        out = []
        evicted: list[BlockKey] = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            assert block.ref_cnt == 0, f"free block {block.block_id} has refs"
            if block.block_key is not None:
                del self._cached[block.block_key]
                evicted.append(block.block_key)
            block.reset()
            block.ref_cnt = 1
            out.append(block)
        if evicted:
            self._events.append(BlockRemoved(tuple(evicted)))
        out.sort(key=_block_id)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks a request reuses (removes them from the queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the queue tail in this order
        (pass a request's blocks tail first, so its last blocks are evicted first)."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if self.enable_caching and block.block_key is not None:
                    self._free[block.block_id] = block
                else:
                    block.reset()
                    self._free[block.block_id] = block
                    self._free.move_to_end(block.block_id, last=False)

    def cache_block(self, block: KVBlock, key: BlockKey, token_ids: Sequence[int]) -> bool:
        """Register a full, computed block under ``key``.

        Returns False (and leaves the block unregistered) when caching is off or ``key``
        already has a block: one entry per key, never duplicates (BUG-09).
        """
        block.is_computed = True
        if not self.enable_caching or key in self._cached or block.block_key is not None:
            return False
        block.block_key = key
        block.token_ids = tuple(token_ids)
        self._cached[key] = block
        self._events.append(BlockStored((key,)))
        return True

    def take_events(self) -> list[KVEvent]:
        """KV events since the last call (for the conductor's prefix index)."""
        events, self._events = self._events, []
        return events

    def reset_prefix_cache(self) -> int:
        """Drop every unreferenced cached block's key; returns how many were dropped."""
        dropped = [b for b in self._cached.values() if b.ref_cnt == 0]
        keys = tuple(b.block_key for b in dropped if b.block_key is not None)
        for b in dropped:
            del self._cached[b.block_key]  # type: ignore[arg-type]
            b.reset()
        if keys:
            self._events.append(BlockRemoved(keys))
        return len(dropped)

    def check_integrity(self) -> None:
        """Assert the pool invariants: free ⇔ ref 0; map entries point at their own key."""
        for b in self.blocks:
            assert (b.ref_cnt == 0) == (b.block_id in self._free), f"block {b.block_id} state"
            assert b.ref_cnt >= 0
        for key, b in self._cached.items():
            assert b.block_key == key, f"cache entry {key} points at block keyed {b.block_key}"
            assert b.token_ids is not None and b.is_computed
        keyed = [b for b in self.blocks if b.block_key is not None]
        assert len(keyed) == len(self._cached), "orphan keyed blocks outside the cache map"
