"""KV cache manager: ``get_computed_blocks`` / ``allocate_slots`` / ``cache_blocks`` / ``free``.

Hides the ``BlockPool`` from the scheduler (vLLM v1's KVCacheManager). No torch.

Full-prefix-hit rule (CASES BUG-09): a cache hit always leaves at least one token to
compute, because the next token must be sampled from fresh logits. When every block of the
request's tokens is cached (the token count is a multiple of the block size and all full
blocks hit), the **whole last block is recomputed**: ``num_cached_tokens = num_tokens -
block_size`` (16 of 32 for two 16-token blocks), never 31 and never 32. Recomputing whole
blocks means the engine never writes into a cached (computed, possibly shared) block; the
recomputed copy is not registered again, since its key is already in the map, so the table
keeps exactly one entry per key.

::

    tokens   |<------ block 0 ------>|<------ block 1 ------>|
    cached   [  h0 (hit, shared)     ][  h1 (hit, dropped)   ]
    compute                           ^ 16 tokens recomputed into a fresh block
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pymooncake.engine.kv.block_pool import BlockPool, KVBlock

if TYPE_CHECKING:
    from pymooncake.engine.request import Request


class KVCacheManager:
    """Per-request block tables over one ``BlockPool`` of ``block_size``-token blocks."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self.num_hit_blocks = 0
        self.num_queried_blocks = 0

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of ``req``'s full blocks, and its token count.

        Applies the full-hit rule above (at least one block is left to compute). Does not
        take references: pass the blocks to ``allocate_slots``.
        """
        if not self.pool.enable_caching:
            return [], 0
        hits: list[KVBlock] = []
        keys = req.block_keys
        for i, key in enumerate(keys):
            block = self.pool.get_cached_block(key, req.block_token_ids(i))
            if block is None:
                break
            hits.append(block)
        if hits and len(hits) * self.block_size >= req.num_tokens:
            hits.pop()
        self.num_queried_blocks += len(keys)
        self.num_hit_blocks += len(hits)
        return hits, len(hits) * self.block_size

    def num_cached_prefix_tokens(self, req: Request) -> int:
        """Tokens of ``req``'s prefix that ``get_computed_blocks`` would reuse now (same
        full-hit rule), without counting a query or a hit: for ordering the queue."""
        if not self.pool.enable_caching:
            return 0
        n = 0
        for i, key in enumerate(req.block_keys):
            if not self.pool.holds(key, req.block_token_ids(i)):
                break
            n += 1
        if n and n * self.block_size >= req.num_tokens:
            n -= 1
        return n * self.block_size

    def num_blocks_needed(self, req: Request, num_new_tokens: int,
                          new_computed_blocks: list[KVBlock] = (),  # type: ignore[assignment]
                          num_external_tokens: int = 0) -> int:
        have = len(self.req_to_blocks.get(req.request_id, ())) + len(new_computed_blocks)
        total = (req.num_computed_tokens + len(new_computed_blocks) * self.block_size
                 + num_external_tokens + num_new_tokens)
        return max(0, -(-total // self.block_size) - have)

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] = (),  # type: ignore[assignment]
                       num_external_tokens: int = 0) -> list[KVBlock] | None:
        """Reserve blocks for ``num_external_tokens`` to load and ``num_new_tokens`` to
        compute after ``req.num_computed_tokens`` (+ the cached ``new_computed_blocks``).

        Returns the newly allocated blocks (fresh, ``ref_cnt == 1``, not computed; an
        external load may write only into these), or ``None`` when too few blocks are free
        (nothing is changed then). The external tokens may end inside a block (P→D: the
        prompt's partial last block); this step's tokens then continue in that block, and
        ``cache_blocks`` registers it once it is full.

        ::

            | computed | new_computed (cached) | external (load) | new (compute) |
                        ^ touched, shared       ^ fresh blocks from here on
        """
        num_new_blocks = self.num_blocks_needed(req, num_new_tokens, new_computed_blocks,
                                                num_external_tokens)
        num_evictable_touched = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_evictable_touched:
            return None
        blocks = self.req_to_blocks.setdefault(req.request_id, [])
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            self._num_cached_blocks[req.request_id] = len(blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, req: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full and computed up to
        ``num_computed_tokens`` (called after the step that computed them)."""
        blocks = self.req_to_blocks.get(req.request_id, [])
        start = self._num_cached_blocks.get(req.request_id, 0)
        end = min(num_computed_tokens // self.block_size, len(blocks))
        if end <= start:
            return
        keys = req.block_keys
        for i in range(start, end):
            self.pool.cache_block(blocks[i], keys[i], req.block_token_ids(i))
        self._num_cached_blocks[req.request_id] = end

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first (its last blocks are evicted first)."""
        blocks = self.req_to_blocks.pop(req.request_id, [])
        self._num_cached_blocks.pop(req.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, req: Request) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(req.request_id, [])]

    def get_blocks(self, req: Request) -> list[KVBlock]:
        return self.req_to_blocks.get(req.request_id, [])

    def check_integrity(self) -> None:
        """Pool invariants, plus: every reference is held by exactly one block table entry."""
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            assert b.ref_cnt == refs.get(b.block_id, 0), f"block {b.block_id} refcount"
