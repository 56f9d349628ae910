"""The C kernels (``pymooncake.engine.kernels``) against PyTorch references computed here:
decode and prefill attention read in place from a paged cache with shuffled block tables,
RMSNorm, RoPE + K/V write; bad layouts refused; the fallback when disabled."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch.nn import functional as F

from pymooncake.engine import SamplingParams, kernels
from pymooncake.engine.model.layers import apply_rope, rope_cos_sin, rope_inv_freq

from .conftest import make_engine, random_prompts

pytestmark = pytest.mark.skipif(not kernels.available(),
                                reason=f"C kernels unavailable: {kernels.why_unavailable()}")


def _paged(kv_heads: int, d: int, bs: int, lens: list[int], seed: int):
    """A cache ``[2, kv_heads, blocks, bs, d]`` with each sequence's blocks at shuffled ids,
    and the sequences' contiguous K/V ``[2, kv_heads, len, d]`` for the reference."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in lens]
    num_blocks = sum(need) + 3
    cache = torch.randn(2, kv_heads, num_blocks, bs, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, seqs, at = [], [], 0
    for n, k in zip(lens, need, strict=True):
        ids = perm[at:at + k]
        at += k
        tables.append(ids)
        seqs.append(cache[:, :, ids].reshape(2, kv_heads, k * bs, d)[:, :, :n])
    return cache, tables, seqs


def _ref_attention(q: torch.Tensor, kv: torch.Tensor, scale: float,
                   mask: torch.Tensor | None) -> torch.Tensor:
    """``q`` ``[n, heads, d]`` over ``kv`` ``[2, kv_heads, ctx, d]`` in float64."""
    qh = q.transpose(0, 1).unsqueeze(0).double()
    o = F.scaled_dot_product_attention(qh, kv[0].unsqueeze(0).double(),
                                       kv[1].unsqueeze(0).double(), attn_mask=mask,
                                       scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1).float()


@pytest.mark.parametrize("heads,kv_heads,d,bs", [(9, 3, 64, 16), (4, 4, 32, 8), (8, 2, 128, 16),
                                                  (4, 1, 64, 16), (8, 8, 64, 8),
                                                  (10, 2, 64, 16), (8, 2, 32, 16)])
def test_paged_decode_matches_reference(heads: int, kv_heads: int, d: int, bs: int) -> None:
    lens = [1, 17, 161, 33, 5]  # the longest not a multiple of 16: padded scratch rows
    cache, tables, seqs = _paged(kv_heads, d, bs, lens, seed=heads + d)
    width = max(map(len, tables)) + 2  # padded rows, as the runner builds them
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * d)
    q = qkv[:, :heads * d].view(len(lens), heads, d)  # token stride > heads * d
    out = kernels.paged_decode(q, cache, table_t, torch.tensor(lens), 0.125)
    for i, kv in enumerate(seqs):
        ref = _ref_attention(q[i:i + 1], kv, 0.125, None)
        torch.testing.assert_close(out[i:i + 1], ref, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("d", [64, 32, 128])
@pytest.mark.parametrize("ctx,n", [(512, 512), (300, 100), (7, 7), (50, 1), (1000, 300),
                                   (700, 700)])
def test_prefill_attention_is_causal_over_prefix_and_chunk(d: int, ctx: int, n: int) -> None:
    heads, kv_heads, bs = 9, 3, 16
    cache, (blocks,), (kv,) = _paged(kv_heads, d, bs, [ctx], seed=ctx + n)
    q = torch.randn(n, heads, d)
    out = torch.full((n, heads, d), float("nan"))
    kernels.prefill_attention(q, cache, torch.tensor(blocks), ctx, 0.125, out)
    mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    torch.testing.assert_close(out, _ref_attention(q, kv, 0.125, mask), rtol=1e-5, atol=2e-6)


def test_rms_norm_matches_torch() -> None:
    x = torch.randn(37, 2 * 576)[:, :576] * 3  # strided rows
    w = torch.randn(576)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5),
                               F.rms_norm(x, (576,), w, 1e-5), rtol=2e-6, atol=2e-6)


def test_rope_write_rotates_in_place_and_fills_the_slots() -> None:
    heads, kv_heads, d, bs, t = 9, 3, 64, 16, 21
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d)
    positions = torch.arange(100, 100 + t)
    cos, sin = rope_cos_sin(torch.arange(4096), rope_inv_freq(d, 10000.0, None), torch.float32)
    cache = torch.zeros(2, kv_heads, 8, bs, d)
    slots = torch.tensor([(5 - p // bs) * bs + p % bs for p in range(t)])  # blocks 5, 4
    expect_q = apply_rope(qkv[:, :heads * d].view(t, heads, d), cos[positions], sin[positions])
    expect_k = apply_rope(qkv[:, heads * d:(heads + kv_heads) * d].view(t, kv_heads, d),
                          cos[positions], sin[positions])
    v = qkv[:, (heads + kv_heads) * d:].view(t, kv_heads, d).clone()
    kernels.rope_write(qkv, positions, cos.view(4096, d), sin.view(4096, d), cache, slots,
                       heads, kv_heads)
    torch.testing.assert_close(qkv[:, :heads * d].view(t, heads, d), expect_q)
    for i, s in enumerate(slots.tolist()):
        torch.testing.assert_close(cache[0, :, s // bs, s % bs], expect_k[i])
        assert torch.equal(cache[1, :, s // bs, s % bs], v[i])
    assert int((cache != 0).any(-1).sum()) == 2 * kv_heads * t  # nothing else written


@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (37, 5), (64, 3), (37, 19)])
def test_gemv_matches_float64_reference(k: int, n: int) -> None:
    g = torch.Generator().manual_seed(k + n)
    w, x = torch.randn(n, k, generator=g), torch.randn(1, k, generator=g)
    b, r = torch.randn(n, generator=g), torch.randn(1, n, generator=g)
    ref = F.linear(x.double(), w.double(), b.double()) + r.double()
    torch.testing.assert_close(kernels.gemv(x, w, b, r).double(), ref, rtol=1e-5,
                               atol=1e-6 * k ** 0.5)
    torch.testing.assert_close(kernels.gemv(x, w).double(), F.linear(x.double(), w.double()),
                               rtol=1e-5, atol=1e-6 * k ** 0.5)


def test_silu_mul_matches_torch() -> None:
    gu = torch.randn(3, 2 * 300) * 8  # both tails of the sigmoid
    ref = F.silu(gu[:, :300]) * gu[:, 300:]
    torch.testing.assert_close(kernels.silu_mul(gu), ref, rtol=2e-6, atol=1e-6)


def test_bad_layouts_are_refused() -> None:
    cache = torch.zeros(2, 3, 4, 16, 64)
    with pytest.raises(ValueError, match="float32"):
        kernels.paged_decode(torch.zeros(1, 9, 64, dtype=torch.float64), cache,
                             torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64),
                             0.1)
    with pytest.raises(ValueError, match="int64"):
        kernels.paged_decode(torch.zeros(1, 9, 64), cache, torch.zeros(1, 1, dtype=torch.int32),
                             torch.ones(1, dtype=torch.int64), 0.1)
    with pytest.raises(ValueError, match="covering"):
        kernels.prefill_attention(torch.zeros(20, 9, 64), cache, torch.zeros(1, dtype=torch.int64),
                                  20, 0.1, torch.zeros(20, 9, 64))
    with pytest.raises(ValueError, match="weight"):
        kernels.rms_norm(torch.zeros(2, 8), torch.zeros(7), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.gemv(torch.zeros(1, 8), torch.zeros(8, 4).t())
    with pytest.raises(ValueError, match="2n"):
        kernels.silu_mul(torch.zeros(2, 7))


def test_disabled_kernels_fall_back_with_a_reason() -> None:
    code = ("from pymooncake.engine import kernels; "
            "print(kernels.available(), '|', kernels.why_unavailable())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYMOONCAKE_KERNELS": "0"}, timeout=120, check=True)
    assert out.stdout.strip() == "False | PYMOONCAKE_KERNELS=0"


def test_a_failed_build_falls_back_with_the_compiler_error(tmp_path) -> None:
    code = ("from pymooncake.engine import kernels; "
            "print(kernels.available(), '|', kernels.why_unavailable())")
    env = {**os.environ, "CC": "false", "PYMOONCAKE_KERNEL_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120, check=True)
    assert out.stdout.startswith("False | kernel build failed"), out.stdout


@pytest.mark.parametrize("mlp_rows", [1024, 16])
def test_engine_fused_path_equals_module_path(mlp_rows: int, monkeypatch) -> None:
    """The engine's float32 step through the fused path (C kernels, oneDNN post-ops) gives
    the module path's tokens and logits up to float32 rounding (tiny model: head_dim 32,
    the kernels' generic code), through chunked prefill, a cached prefix and decode; also
    with the MLP run in row chunks (``fused.MLP_ROWS``) smaller than a step."""
    from pymooncake.engine.model import fused as fused_step
    monkeypatch.setattr(fused_step, "MLP_ROWS", mlp_rows)
    prompts = random_prompts(5, 10, 90, seed=4)
    params = SamplingParams(max_tokens=12, return_logits=True)
    fused = make_engine(max_num_batched_tokens=64, prefill_chunk_tokens=32)
    assert fused.model.use_fused_path and fused.runner.use_kernels
    plain = make_engine(max_num_batched_tokens=64, prefill_chunk_tokens=32)
    plain.model.use_fused_path = False
    plain.runner.use_kernels = False
    # one prompt alone: its decode steps are one row (kernels.gemv, silu_mul)
    rounds = [prompts, prompts, prompts[:1]]  # the second round hits the prefix cache
    for batch in rounds:
        a, b = fused.generate(batch, params), plain.generate(batch, params)
        for x, y in zip(a, b, strict=True):
            assert x.output_token_ids == y.output_token_ids
            lx, ly = torch.stack(list(x.logits)), torch.stack(list(y.logits))
            assert float((lx - ly).abs().max()) <= 2e-6 * float(ly.abs().max())


def test_one_call_decode_layers_equal_the_per_call_path(monkeypatch) -> None:
    """Batch-1 decode through ``kernels.DecodeLayers`` (one C call per layer) gives the
    per-call one-row path's tokens and logits bit for bit (same kernels, same order)."""
    from pymooncake.engine.model import fused as fused_step
    prompts = random_prompts(2, 20, 70, seed=9)
    params = SamplingParams(max_tokens=10, return_logits=True)
    one_call = make_engine()
    per_call = make_engine()
    for p in prompts:  # one prompt at a time: every decode step is one row
        a = one_call.generate([p], params)[0]
        with monkeypatch.context() as m:
            m.setattr(fused_step, "_decode_layers", lambda *_: None)
            b = per_call.generate([p], params)[0]
        assert a.output_token_ids == b.output_token_ids
        assert torch.equal(torch.stack(list(a.logits)), torch.stack(list(b.logits)))
    assert isinstance(one_call.model.__dict__.get("_decode_layers"), kernels.DecodeLayers)


@pytest.mark.parametrize("m,k,n", [(2, 576, 960), (3, 1536, 576), (8, 37, 19), (5, 64, 3)])
def test_gemv_rows_give_each_row_its_own_floats(m: int, k: int, n: int) -> None:
    """``kernels.gemv`` on m rows (``pmk_gemv_rows_f32``: weight tiles read once for all
    rows) gives every row bit for bit what the one-row GEMV gives it alone (so a decode
    batch does not change a sequence's floats), and the float64 reference up to rounding;
    k = 1536 splits W into 16-row tiles, k = 37 leaves a masked tail."""
    g = torch.Generator().manual_seed(m * k + n)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    b, r = torch.randn(n, generator=g), torch.randn(m, n, generator=g)
    y = kernels.gemv(x, w, b, r)
    for i in range(m):
        assert torch.equal(y[i:i + 1], kernels.gemv(x[i:i + 1], w, b, r[i:i + 1]))
    ref = F.linear(x.double(), w.double(), b.double()) + r.double()
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6 * k ** 0.5)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.gemv(x, w, b, r[:, :1])  # a residual of the wrong size


def decode_row_by_row(model, dl, x, positions, meta, _before, _after, cos_t, sin_t):
    """A stand-in for ``fused._forward_decode`` that runs each row of the step alone
    through the one-row C call (``pmk_decode_layer_f32``): the reference the batched rows
    must equal bit for bit (also used by docs/data/issue16_s38/smol_invariance.py)."""
    out = []
    for r in range(x.shape[0]):
        dl.set_step([int(positions[r])], [int(meta.slot_mapping[r])],
                    meta.decode_tables[r:r + 1], [int(meta.decode_ctx_lens[r])],
                    cos_t, sin_t)
        xr = x[r:r + 1].contiguous().clone()
        for i in range(len(model.model.layers)):
            dl.run(i, xr)
        out.append(xr)
    return kernels.rms_norm(torch.cat(out), model.model.norm.weight,
                            model.config.rms_norm_eps)


def test_batched_decode_rows_equal_each_sequence_decoded_alone(monkeypatch) -> None:
    """A decode step of several sequences through ``kernels.DecodeLayers``
    (``pmk_decode_layer_rows_f32``) gives each sequence the tokens and logits, bit for bit,
    of its own one-row decode over the same cache (``pmk_decode_layer_f32`` row by row)."""
    from pymooncake.engine.model import fused as fused_step
    seen: list[int] = []
    batched = fused_step._forward_decode

    def spy(model, dl, x, *rest):
        seen.append(x.shape[0])
        return batched(model, dl, x, *rest)

    prompts = random_prompts(3, 20, 70, seed=11)
    params = SamplingParams(max_tokens=10, return_logits=True)
    monkeypatch.setattr(fused_step, "_forward_decode", spy)
    a = make_engine().generate(prompts, params)
    assert max(seen) == 3  # the three sequences decoded in one step
    monkeypatch.setattr(fused_step, "_forward_decode", decode_row_by_row)
    b = make_engine().generate(prompts, params)
    for x, y in zip(a, b, strict=True):
        assert x.output_token_ids == y.output_token_ids
        assert torch.equal(torch.stack(list(x.logits)), torch.stack(list(y.logits)))


def test_decode_rows_bound_follows_weights_tile_and_threads() -> None:
    """``decode_rows_max``: cache-resident weights take 8 rows; memory-bound ones 8 with the
    4-row GEMV tile on one thread, 4 on more; on AVX2 (8 lanes, no tile) 4 on one thread,
    2 on more; in plain C 2. ``DecodeLayers`` passes the library's tile and lanes and
    torch's threads (a SmolLM2-sized LM head on the tiny layers)."""
    big, small = 540 << 20, 11 << 20
    assert kernels.decode_rows_max(small, 1, 2, 1) == kernels.DECODE_ROWS_MAX == 8
    assert kernels.decode_rows_max(big, 4, 1, 16) == 8
    assert kernels.decode_rows_max(big, 4, 2, 16) == 4
    assert kernels.decode_rows_max(big, 1, 1, 8) == 4
    assert kernels.decode_rows_max(big, 1, 2, 8) == 2
    assert kernels.decode_rows_max(big, 1, 1, 1) == 2
    engine = make_engine()
    layers, eps = list(engine.model.model.layers), engine.model.config.rms_norm_eps
    lib = kernels.library()
    tile, lanes = lib.pmk_gemv_row_tile(), lib.pmk_gemv_lanes()
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            dl = kernels.DecodeLayers(layers, engine.kv.layer_caches, eps, extra_weight_bytes=big)
            want = ((8 if n == 1 else 4) if tile >= 4
                    else 4 if n == 1 and lanes >= 8 else 2)
            assert dl.max_rows == want
    finally:
        torch.set_num_threads(threads)


def test_gemv_tile_and_lanes_follow_cpu_flags() -> None:
    """``pmk_gemv_row_tile`` says 4 exactly when the kernels (built ``-march=native``) have
    AVX-512, i.e. when the CPU has it; ``pmk_gemv_lanes`` 16 then, 8 with AVX2 and FMA,
    else 1."""
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        flags = next((ln for ln in f if ln.startswith("flags")), "").split()
    avx512 = "avx512f" in flags
    lib = kernels.library()
    assert lib.pmk_gemv_row_tile() == (4 if avx512 else 1)
    assert lib.pmk_gemv_lanes() == (16 if avx512 else 8 if {"avx2", "fma"} <= set(flags)
                                    else 1)


def test_decode_layers_refuse_a_step_they_cannot_take() -> None:
    """``DecodeLayers.set_step`` refuses more than ``DECODE_ROWS_MAX`` sequences and a
    block table shorter than a context, naming the limit."""
    engine = make_engine()
    engine.generate(random_prompts(1, 20, 20, seed=1), SamplingParams(max_tokens=2))
    dl = engine.model.__dict__["_decode_layers"]
    lm = engine.model.lm_head.weight
    assert dl.weight_bytes + lm.numel() * 4 < kernels.decode_rows_max.__globals__[
        "CACHED_WEIGHTS_BYTES"] and dl.max_rows == kernels.DECODE_ROWS_MAX == 8
    cos_t = sin_t = torch.zeros(64, 32)
    n = kernels.DECODE_ROWS_MAX + 1
    with pytest.raises(ValueError, match=f"1..{kernels.DECODE_ROWS_MAX} sequences"):
        dl.set_step([1] * n, [1] * n, torch.zeros(n, 1, dtype=torch.int64), [2] * n,
                    cos_t, sin_t)
    with pytest.raises(ValueError, match="covering each ctx_len"):
        dl.set_step([40], [40], torch.zeros(1, 1, dtype=torch.int64), [41], cos_t, sin_t)


def test_decode_layers_set_step_writes_every_sequence_row() -> None:
    """``DecodeLayers.set_step`` with m = 3 sequences: row r of the step plan holds that
    sequence's position, slot, block-table row address (base + r * row stride), context
    and the RoPE tables' addresses, in that order; the rows past m are left alone."""
    engine = make_engine()
    engine.generate(random_prompts(1, 20, 20, seed=1), SamplingParams(max_tokens=2))
    dl = engine.model.__dict__["_decode_layers"]
    with torch.inference_mode():  # the plan was made under it
        dl.step.fill_(-7)
    cos_t, sin_t = torch.zeros(64, 32), torch.zeros(64, 32)
    tables = torch.zeros(3, 4, dtype=torch.int64)
    dl.set_step([5, 17, 40], [105, 217, 340], tables, [6, 18, 41], cos_t, sin_t)
    row_bytes = tables.stride(0) * 8
    assert dl.rows == 3
    assert dl.step[:3].tolist() == [
        [p, s, tables.data_ptr() + r * row_bytes, c, cos_t.data_ptr(), sin_t.data_ptr()]
        for r, (p, s, c) in enumerate([(5, 105, 6), (17, 217, 18), (40, 340, 41)])]
    assert (dl.step[3:] == -7).all()


def test_rope_table_covers_every_position_and_follows_the_dtype() -> None:
    """``LlamaForCausalLM.rope_table``: a table of 4096 positions serves position 4095, one
    at 4096 grows it to 8192; another dtype gives a table of that dtype; the rows
    ``_cos_sin`` takes from it equal ``rope_cos_sin`` computed for those positions alone
    (float32 and float64), and ``fused.rope_tables`` is the same table as ``[P, head_dim]``."""
    from pymooncake.engine.model import fused
    model = make_engine().model
    pos = torch.tensor([0, 4095, 17])
    cos_t, sin_t = model.rope_table(pos, torch.float32)
    assert cos_t.shape[0] == sin_t.shape[0] == 4096 and cos_t.dtype == torch.float32
    assert model.rope_table(torch.tensor([4096]), torch.float32)[0].shape[0] == 8192
    for dtype in (torch.float64, torch.float32):
        table = model.rope_table(pos, dtype)
        assert table[0].dtype == table[1].dtype == dtype
        cos, sin = model._cos_sin(pos, dtype)
        ref_cos, ref_sin = rope_cos_sin(pos, model.inv_freq, dtype)
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    flat_cos, flat_sin = fused.rope_tables(model, pos, torch.float32)
    assert flat_cos.shape == (cos_t.shape[0], cos_t.shape[-1])
    ref_cos, ref_sin = rope_cos_sin(torch.tensor([4095]), model.inv_freq, torch.float32)
    assert torch.equal(flat_cos[4095], ref_cos.view(-1))
    assert torch.equal(flat_sin[4095], ref_sin.view(-1))


def test_argmax_rows_is_torch_argmax() -> None:
    """Greedy sampling's C argmax: the first index of each row's largest value (ties), NaN
    counted as the largest (its first index), a strided row view, every length mod 64."""
    g = torch.Generator().manual_seed(5)
    for n in (1, 15, 64, 65, 200, 49152):
        x = torch.randn(7, n, generator=g)
        assert kernels.argmax_rows(x) == torch.argmax(x, dim=-1).tolist()
    x = torch.zeros(4, 130)
    x[0, [3, 70, 129]] = 2.0  # a tie: the first
    x[1, 129] = 1.0  # in the last partial chunk
    x[2, [10, 90]] = float("nan")
    x[2, 5] = 9.0  # NaN beats any number
    x[3] = float("-inf")
    assert kernels.argmax_rows(x) == [3, 129, 10, 0] == torch.argmax(x, dim=-1).tolist()
    wide = torch.randn(3, 300, generator=g)
    view = wide[:, :257]  # row stride 300, unit column stride
    assert kernels.argmax_rows(view) == torch.argmax(view, dim=-1).tolist()
