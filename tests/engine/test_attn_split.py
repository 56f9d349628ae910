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


@pytest.mark.parametrize(("ctx_len", "n", "bs"), [
    (3000, 512, 16), (700, 700, 16), (1500, 300, 16), (90, 40, 16),
    # short chunks after a long prefix: the kernel's threads in smaller groups
    # (``OMP_SPLIT_MIN_WORK``, ``pmk_flash_group_vecs``)
    (2400, 64, 128), (1200, 48, 128), (600, 64, 128), (300, 7, 128),
])
def test_split_attention_equals_one_call_bit_for_bit(ctx_len, n, bs):
    torch.manual_seed(ctx_len + n)
    heads, kv_heads, d = 9, 3, 64
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


_ONE_RUNTIME = """
import torch
from pymooncake.engine import kernels
q = torch.randn(512, 9, 64); out = torch.empty_like(q)
cache = torch.randn(2, 3, 40, 128, 64); blocks = torch.arange(40, dtype=torch.int64)
torch.set_num_threads(2)
kernels.prefill_attention(q, cache, blocks, 5000, 0.125, out)
torch.nn.functional.linear(torch.randn(64, 64), torch.randn(64, 64))
paths = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line})
print(kernels.library().pmk_prefill_threads_inside(64), len(paths), paths)
"""


def test_the_kernels_share_torchs_openmp_runtime():
    """Built with OpenMP, the library's libgomp is the one torch loaded (one runtime, one
    team of threads for GEMMs and attention alike), and head_dim 64 uses it."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _ONE_RUNTIME], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split(maxsplit=2)
    if out[0] == "0":
        pytest.skip("kernels built without OpenMP or without AVX-512 here")
    assert out[1] == "1", out[2]


def test_without_openmp_the_library_rebuilds_without_it_and_splits_rows(tmp_path):
    """A compiler that refuses -fopenmp: the kernels still build (no OpenMP), answer 0 to
    pmk_prefill_threads_inside, and the Python row split gives the same bits."""
    import os
    import shutil
    import subprocess
    import sys
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    wrapper = tmp_path / "cc-no-openmp"
    wrapper.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && exit 1; done\n'
                       f'exec {cc} "$@"\n')
    wrapper.chmod(0o755)
    code = ("import torch\nfrom pymooncake.engine import kernels\n"
            "torch.manual_seed(0)\nq = torch.randn(300, 9, 64)\n"
            "cache = torch.randn(2, 3, 12, 128, 64)\n"
            "blocks = torch.arange(12, dtype=torch.int64)\n"
            "a, b = torch.empty_like(q), torch.empty_like(q)\n"
            "torch.set_num_threads(1); kernels.prefill_attention(q, cache, blocks, 1400, .125, a)\n"
            "torch.set_num_threads(2); kernels.prefill_attention(q, cache, blocks, 1400, .125, b)\n"
            "print(kernels.available(), kernels.library().pmk_prefill_threads_inside(64), "
            "torch.equal(a, b))\n")
    env = {**os.environ, "CC": str(wrapper), "PYMOONCAKE_KERNEL_CACHE": str(tmp_path / "k")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300, check=True).stdout.split()
    assert out == ["True", "0", "True"]


def test_row_kernels_on_two_threads_equal_one_thread_bit_for_bit():
    """RMSNorm, SiLU-multiply and RoPE + K/V write spread rows over torch's threads above
    PMK_PAR_MIN_WORK floats; rows are independent, so the bits do not change."""
    from pymooncake.engine.model.layers import rope_cos_sin, rope_inv_freq
    torch.manual_seed(1)
    x, w, gu = torch.randn(512, 576), torch.randn(576), torch.randn(512, 2 * 1536)
    qkv = torch.randn(512, 15 * 64)
    pos = torch.arange(512)
    cos, sin = rope_cos_sin(torch.arange(1024), rope_inv_freq(64, 10000.0, None), torch.float32)
    slots = torch.randperm(40 * 16)[:512]
    threads = torch.get_num_threads()
    res = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            cache, q = torch.zeros(2, 3, 40, 16, 64), qkv.clone()
            kernels.rope_write(q, pos, cos.view(1024, 64), sin.view(1024, 64), cache, slots, 9, 3)
            res.append((kernels.rms_norm(x, w, 1e-5), kernels.silu_mul(gu), q, cache))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*res, strict=True):
        assert torch.equal(a, b)
    assert res[0][3].abs().sum() > 0    # the K/V rows were written


def test_paged_decode_on_two_threads_equals_one_thread_bit_for_bit():
    """Decode attention splits its (sequence, KV head) items over torch's threads once the
    context read is large (PMK_DEC_PAR_MIN_WORK); each item is computed as on one thread."""
    torch.manual_seed(2)
    kv_heads, heads, d, bs, nb = 3, 9, 64, 16, 400
    cache = torch.randn(2, kv_heads, nb, bs, d)
    lens = [1500, 7, 900, 3000, 64]                  # above the threshold together
    tables = torch.stack([torch.randperm(nb)[:3000 // bs + 1] for _ in lens])
    q = torch.randn(len(lens), heads, d)
    threads = torch.get_num_threads()
    res = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            res.append(kernels.paged_decode(q, cache, tables, torch.tensor(lens), 0.125))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(res[0], res[1])
    # and against plain attention over the gathered context of one sequence (float64)
    kv = cache[:, :, tables[3]].reshape(2, kv_heads, -1, d)[:, :, :3000].double()
    s = torch.einsum("hd,hkd->hk", q[3].double(), kv[0].repeat_interleave(3, 0)) * 0.125
    ref = torch.einsum("hk,hkd->hd", s.softmax(-1), kv[1].repeat_interleave(3, 0))
    torch.testing.assert_close(res[1][3].double(), ref, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize(("nvec", "kv_heads", "threads", "want"), [
    (192, 3, 2, 48),     # a 64-token chunk, 9 heads / 3 KV heads: 4 groups a head, 12 items
    (144, 3, 2, 36),     # 48 tokens: ceil(144 / 4) = 36, a multiple of 6 already
    (1536, 3, 2, 192),   # 512 tokens: the full 192-vector groups (8 a head, 24 items)
    (30, 3, 2, 24),      # ceil(30 / 4) = 8 -> 12 -> raised to the 24-vector floor
    (200, 3, 2, 54),     # ceil(200 / 4) = 50 -> rounded up to a multiple of 6
    (192, 3, 1, 192),    # one thread: no reason to cut
    (192, 1, 4, 24),     # 1 KV head, 4 threads: 24 groups wanted, ceil(192/24) = 8 -> 24
])
def test_flash_group_size_gives_every_thread_work(nvec, kv_heads, threads, want):
    """The blocked kernel's query vectors per (KV head, group) item, by hand: at most 192,
    else ceil(nvec / ceil(6 * threads / kv_heads)) rounded up to a multiple of 6, at least
    24."""
    lib = kernels.library()
    if not hasattr(lib, "pmk_flash_group_vecs"):
        pytest.skip("no AVX-512 blocked kernel in this build")
    assert lib.pmk_flash_group_vecs(nvec, kv_heads, threads) == want
