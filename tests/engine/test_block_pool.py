"""Pure cores: block pool (LRU reuse, refcounts, one entry per key), KV cache manager, and
request block keys. No torch needed."""

from __future__ import annotations

import subprocess
import sys

from pymooncake.engine.kv.block_pool import BlockPool, BlockRemoved, BlockStored
from pymooncake.engine.kv.kv_cache_manager import KVCacheManager
from pymooncake.engine.request import Request
from pymooncake.engine.sampling import SamplingParams
from pymooncake.identity import CacheNamespace, block_keys


def _ns(block_size: int = 4) -> CacheNamespace:
    return CacheNamespace(model_id="m", weight_revision="w", tokenizer_fingerprint="t",
                          kv_dtype="float32", kv_layout="l", block_size=block_size)


def test_pure_cores_import_without_torch() -> None:
    code = ("import sys; import pymooncake.engine.kv.block_pool, "
            "pymooncake.engine.kv.kv_cache_manager, pymooncake.engine.scheduler, "
            "pymooncake.engine.request; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_lru_reuse_order_and_events() -> None:
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    assert [x.block_id for x in (a, b, c)] == [0, 1, 2]
    pool.cache_block(a, "ka", (1,))
    pool.cache_block(b, "kb", (2,))
    assert pool.take_events() == [BlockStored(("ka",)), BlockStored(("kb",))]
    pool.free_blocks([b, a, c])  # c is uncached: reused first; then b, then a (LRU)
    assert pool.num_free_blocks == 4
    assert [x.block_id for x in pool.get_new_blocks(2)] == [2, 3]
    (x,) = pool.get_new_blocks(1)
    assert x.block_id == 1 and x.block_key is None
    assert pool.take_events() == [BlockRemoved(("kb",))]
    assert pool.get_cached_block("ka", (1,)) is a
    pool.check_integrity()


def test_new_blocks_come_in_ascending_ids_so_a_freed_request_is_one_run_again() -> None:
    pool = BlockPool(8)
    first = pool.get_new_blocks(5)
    assert [b.block_id for b in first] == [0, 1, 2, 3, 4]
    for i, b in enumerate(first):
        pool.cache_block(b, f"k{i}", (i,))
    pool.free_blocks(reversed(first))   # tail first, as KVCacheManager.free does
    # LRU order of the free queue is now 5, 6, 7 (never used), then 4, 3, 2, 1, 0
    got = pool.get_new_blocks(6)
    assert {b.block_id for b in got} == {5, 6, 7, 4, 3, 2}   # the LRU's choice, unchanged
    assert [b.block_id for b in got] == [2, 3, 4, 5, 6, 7]   # ...handed out in id order
    assert pool.take_events() == [BlockStored((f"k{i}",)) for i in range(5)] + \
        [BlockRemoved(("k4", "k3", "k2"))]
    pool.check_integrity()


def test_touch_takes_cached_block_off_the_free_queue() -> None:
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, "k", (5,))
    pool.free_blocks([a])
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1
    assert pool.get_new_blocks(1)[0].block_id == 1  # the touched block is not handed out
    assert not pool.cache_block(pool.blocks[1], "k", (5,))  # one entry per key
    pool.check_integrity()


def test_manager_shares_prefix_blocks_and_applies_full_hit_rule() -> None:
    ns = _ns(4)
    pool = BlockPool(16)
    mgr = KVCacheManager(pool, 4)
    r1 = Request("r1", list(range(8)) + [9], SamplingParams(), ns)
    assert mgr.get_computed_blocks(r1) == ([], 0)
    assert len(mgr.allocate_slots(r1, 9)) == 3
    mgr.cache_blocks(r1, 9)
    r2 = Request("r2", list(range(8)) + [7, 7], SamplingParams(), ns)
    hits, n = mgr.get_computed_blocks(r2)
    assert n == 8 and [b.block_id for b in hits] == mgr.get_block_ids(r1)[:2]
    new = mgr.allocate_slots(r2, 2, hits)
    assert len(new) == 1 and [b.ref_cnt for b in hits] == [2, 2]
    r3 = Request("r3", list(range(8)), SamplingParams(), ns)  # whole prompt cached
    hits, n = mgr.get_computed_blocks(r3)
    assert n == 4 and len(hits) == 1  # the last block is recomputed
    mgr.free(r1)
    mgr.free(r2)
    mgr.check_integrity()
    assert pool.num_free_blocks == 16


def test_allocate_fails_cleanly_when_blocks_run_out() -> None:
    pool = BlockPool(2)
    mgr = KVCacheManager(pool, 4)
    r = Request("r", list(range(12)), SamplingParams(), _ns(4))
    assert mgr.allocate_slots(r, 12) is None
    assert pool.num_free_blocks == 2 and mgr.get_block_ids(r) == []


def test_incremental_block_keys_equal_identity() -> None:
    ns = _ns(4)
    r = Request("r", [3, 1, 4, 1, 5], SamplingParams(), ns)
    assert r.block_keys == block_keys([3, 1, 4, 1, 5], ns)
    for t in range(20):
        r.output_token_ids.append(t)
        assert r.block_keys == block_keys(r.all_token_ids, ns)
