"""A prefill chunk's attention split over threads (``kernels.parallel``) computes exactly
what one call computes, and its runs carry about equal work."""

from __future__ import annotations

import pytest
import torch

from pymooncake.engine import kernels
from pymooncake.engine.kernels import parallel

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C compiler for kernels")


@pytest.mark.parametrize(("n", "ctx_len", "parts"), [
    (512, 3000, 2), (512, 512, 2), (100, 5000, 3), (2048, 2048, 4), (7, 9000, 2),
])
def test_runs_have_equal_work_by_brute_force(n, ctx_len, parts):
    cuts = parallel.split_rows(n, ctx_len, parts)
    assert cuts[0] == 0 and cuts[-1] == n and cuts == sorted(set(cuts))
    cost = [ctx_len - n + i + 1 for i in range(n)]     # keys read by row i
    work = [sum(cost[a:b]) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    assert len(work) == parts
    # each run within one row's cost of an equal share
    assert max(abs(w - sum(cost) / parts) for w in work) <= max(cost)


@pytest.mark.parametrize(("ctx_len", "n"), [(3000, 512), (700, 700), (1500, 300), (90, 40)])
def test_split_attention_equals_one_call_bit_for_bit(ctx_len, n):
    torch.manual_seed(ctx_len)
    heads, kv_heads, d, bs = 9, 3, 64, 16
    num_blocks = -(-ctx_len // bs) + 4
    cache = torch.randn(2, kv_heads, num_blocks, bs, d)
    blocks = torch.randperm(num_blocks)[:-(-ctx_len // bs)].to(torch.int64).contiguous()
    q = torch.randn(n, heads, d)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.empty_like(q)
        kernels.prefill_attention(q, cache, blocks, ctx_len, 0.125, one)
        torch.set_num_threads(3)
        split = torch.empty_like(q)
        kernels.prefill_attention(q, cache, blocks, ctx_len, 0.125, split)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, split)
    # and the kernel itself against plain causal softmax attention (GQA: 3 heads a group)
    k = cache[0][:, blocks].reshape(kv_heads, -1, d)[:, :ctx_len]
    v = cache[1][:, blocks].reshape(kv_heads, -1, d)[:, :ctx_len]
    k, v = k.repeat_interleave(3, 0).double(), v.repeat_interleave(3, 0).double()
    s = torch.einsum("nhd,hkd->hnk", q.double(), k) * 0.125
    pos = torch.arange(ctx_len - n, ctx_len)[:, None]
    s = s.masked_fill(torch.arange(ctx_len)[None, :] > pos, float("-inf"))
    ref = torch.einsum("hnk,hkd->nhd", s.softmax(-1), v)
    assert torch.allclose(split.double(), ref, atol=1e-4)
