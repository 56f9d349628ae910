"""Incremental prefill over reused prefix blocks equals full recompute (local prefix cache
and exported/re-imported bytes), and the cases BUG-07, BUG-09, BUG-42."""

from __future__ import annotations

import random

import blake3
import pytest

torch = pytest.importorskip("torch")

from pymooncake.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from pymooncake.identity import block_keys  # noqa: E402

from .conftest import make_engine, random_prompts  # noqa: E402

GREEDY = SamplingParams(max_tokens=4, return_logits=True)


def _run(engine: Engine, prompt: list[int], params: SamplingParams = GREEDY):
    (out,) = engine.generate([prompt], params)
    return out


def _max_diff(a, b) -> float:
    return float((torch.stack(list(a)) - torch.stack(list(b))).abs().max())


@pytest.mark.parametrize("num_hit_blocks", [0, 1, 2, 3])
def test_incremental_prefill_from_local_cache_equals_recompute(num_hit_blocks: int) -> None:
    (prompt,) = random_prompts(1, 57, 57, seed=3)  # 3 full blocks + 9 tokens
    cold = _run(make_engine(), prompt)
    warm_engine = make_engine()
    if num_hit_blocks:
        # cache exactly num_hit_blocks blocks of the prefix (then a different token)
        prefix = prompt[:16 * num_hit_blocks] + [(prompt[16 * num_hit_blocks] + 1) % 256]
        _run(warm_engine, prefix, SamplingParams(max_tokens=1))
    else:
        _run(warm_engine, [256] + [(t + 7) % 256 for t in prompt[1:]])
    warm = _run(warm_engine, prompt)
    assert warm.num_cached_tokens == 16 * num_hit_blocks
    assert warm.output_token_ids == cold.output_token_ids
    assert _max_diff(warm.logits, cold.logits) <= 1e-4
    warm_engine.kv_manager.check_integrity()


@pytest.mark.parametrize("num_blocks", [1, 3])
def test_incremental_prefill_from_imported_bytes_equals_recompute(num_blocks: int) -> None:
    (prompt,) = random_prompts(1, 57, 57, seed=4)
    source = make_engine()
    cold = _run(source, prompt)
    exported = source.export_blocks(prompt[:16 * num_blocks])
    assert len(exported) == num_blocks
    assert all(len(b.data) == source.kv.block_nbytes for b in exported)
    # through plain bytes, as a store or a transfer would carry them
    wire = [type(b)(b.block_key, b.token_ids, bytes(bytearray(b.data)), b.namespace_digest)
            for b in exported]
    target = make_engine()
    assert target.import_blocks(wire) == num_blocks
    warm = _run(target, prompt)
    assert warm.num_cached_tokens == 16 * num_blocks
    assert warm.output_token_ids == cold.output_token_ids
    assert _max_diff(warm.logits, cold.logits) <= 1e-4


def test_imported_blocks_under_another_namespace_are_not_hit() -> None:
    (prompt,) = random_prompts(1, 40, 40, seed=5)
    source = make_engine()
    _run(source, prompt)
    blocks = source.export_blocks(prompt)
    other = make_engine(block_size=8)  # another block size is another namespace
    with pytest.raises(ValueError, match="namespace"):
        other.import_blocks(blocks)
    assert other.pool.num_cached_blocks == 0
    assert _run(other, prompt).num_cached_tokens == 0


def test_bug_09_full_prefix_hit_recomputes_last_block() -> None:
    engine = make_engine(block_size=16)
    (p,) = random_prompts(1, 32, 32, seed=9)
    r1 = _run(engine, p, SamplingParams(max_tokens=4, return_logits=True))
    assert r1.num_cached_tokens == 0
    r2 = _run(engine, p, SamplingParams(max_tokens=4, return_logits=True))
    # documented rule: the whole last block is recomputed -> 16, never 31 or 32
    assert r2.num_cached_tokens == 16
    assert r2.output_token_ids == r1.output_token_ids
    assert float((r2.logits[0] - r1.logits[0]).abs().max()) <= 1e-5
    h0, h1 = block_keys(p, engine.namespace)
    keys = engine.pool.cached_keys()
    assert keys.count(h0) == 1 and keys.count(h1) == 1
    engine.kv_manager.check_integrity()  # no orphans: every keyed block is in the map
    keyed = [b for b in engine.pool.blocks if b.block_key in (h0, h1)]
    assert len(keyed) == 2
    q = [(t + 1) % 256 for t in p[1:17]]
    r3 = _run(engine, p + q)
    assert r3.num_cached_tokens == 32


def _weak_hash(data: bytes) -> bytes:
    return blake3.blake3(data).digest()[:1]  # 8 bits: collisions on purpose


def test_bug_07_pool_lookup_compares_tokens() -> None:
    from pymooncake.engine.kv.block_pool import BlockPool
    pool = BlockPool(4)
    (blk,) = pool.get_new_blocks(1)
    x, y = list(range(1, 17)), list(range(17, 33))
    assert pool.cache_block(blk, "k", x)
    assert pool.get_cached_block("k", y) is None  # same key, other tokens: a miss
    assert pool.num_collisions == 1
    assert pool.get_cached_block("k", x) is blk


def test_bug_07_weak_hash_collision_is_a_miss_end_to_end() -> None:
    engine = Engine.from_model_name("tiny", EngineConfig(), hash_fn=_weak_hash)
    x = [256] + list(range(1, 16))
    kx = block_keys(x, engine.namespace, hash_fn=_weak_hash)[0]
    rng = torch.Generator().manual_seed(0)
    for _ in range(5000):  # find Y != X whose weak key equals X's
        y = [256] + torch.randint(0, 256, (15,), generator=rng).tolist()
        if y != x and block_keys(y, engine.namespace, hash_fn=_weak_hash)[0] == kx:
            break
    else:
        pytest.fail("no 8-bit collision found")
    _run(engine, x + [1, 2, 3])
    prompt = y + [5, 6, 7, 8]
    warm = _run(engine, prompt)
    cold = _run(make_engine(), prompt)
    assert engine.pool.num_collisions >= 1
    assert warm.num_cached_tokens == 0
    assert warm.output_token_ids == cold.output_token_ids
    assert _max_diff(warm.logits, cold.logits) <= 1e-5


def _bug42_runs(dtype: str, prompts: list[list[int]]):
    params = SamplingParams(max_tokens=16, return_logits=True)
    cold = make_engine(dtype=dtype).generate(prompts, params)
    partial_engine = make_engine(dtype=dtype)
    prefixes = [p[:(len(p) // 2 // 16) * 16] for p in prompts]
    partial_engine.generate([pre + [257] for pre in prefixes], SamplingParams(max_tokens=1))
    partial = partial_engine.generate(prompts, params)
    full_engine = make_engine(dtype=dtype)
    full_engine.generate(prompts, SamplingParams(max_tokens=1))
    full = full_engine.generate(prompts, params)
    return cold, partial, full, prefixes


def test_bug_42_cold_vs_warm_logits_and_greedy_tokens() -> None:
    # the case asks for 100 prompts of 40..200 tokens; 24 keep this test near 10 s on 2 cores
    prompts = random_prompts(24, 40, 200, seed=42)
    cold, partial, full, prefixes = _bug42_runs("float32", prompts)
    for i, c in enumerate(cold):
        assert partial[i].num_cached_tokens == len(prefixes[i])
        assert full[i].num_cached_tokens == min((len(prompts[i]) // 16) * 16,
                                                ((len(prompts[i]) - 1) // 16) * 16)
        for warm in (partial[i], full[i]):
            n = min(len(c.logits), len(warm.logits))
            for step in range(n):
                cl, wl = c.logits[step], warm.logits[step]
                assert float((cl - wl).abs().max()) <= 1e-4, (i, step)
                top2 = torch.topk(cl, 2).values
                if float(top2[0] - top2[1]) > 1e-3:
                    assert int(cl.argmax()) == warm.output_token_ids[step], (i, step)
                if warm.output_token_ids[step] != c.output_token_ids[step]:
                    break  # a near-tie flipped: later steps see different inputs


def test_bug_42_fp64_mode_is_exact() -> None:
    prompts = random_prompts(6, 40, 120, seed=43)
    cold, partial, full, _ = _bug42_runs("float64", prompts)
    for c, p, f in zip(cold, partial, full, strict=True):
        assert p.output_token_ids == c.output_token_ids == f.output_token_ids
        assert _max_diff(p.logits, c.logits) == 0.0  # bit-exact in the fp64 mode
        assert _max_diff(f.logits, c.logits) == 0.0


def test_bug_42_fp64_mode_is_exact_for_every_length_40_to_99() -> None:
    """Every prompt length 40..99, i.e. every size 1..16 of the recomputed last block of a
    full hit (1-3 tokens used to differ by ~1e-14: BLAS' few-row GEMM and SDPA's
    short-query kernels reduce in another order). Cold prompts run one batch of 60,
    warm ones another (full hits), and 3 prompts alone: all bit-identical."""
    rng = random.Random(42)
    prompts = [[256] + [rng.randrange(256) for _ in range(n - 1)] for n in range(40, 100)]
    params = SamplingParams(max_tokens=3, return_logits=True, ignore_eos=True)
    cold = make_engine(dtype="float64").generate(prompts, params)
    warm_engine = make_engine(dtype="float64")
    warm_engine.generate(prompts, SamplingParams(max_tokens=1))
    warm = warm_engine.generate(prompts, params)
    alone_engine = make_engine(dtype="float64")
    for i in (9, 25, 58):  # lengths 49, 65, 98 served alone: batch-invariant too
        (a,) = alone_engine.generate([prompts[i]], params)
        assert _max_diff(a.logits, cold[i].logits) == 0.0, len(prompts[i])
    for p, c, w in zip(prompts, cold, warm, strict=True):
        full_blocks = len(p) // 16 - (1 if len(p) % 16 == 0 else 0)
        assert (c.num_cached_tokens, w.num_cached_tokens) == (0, 16 * full_blocks), len(p)
        assert w.output_token_ids == c.output_token_ids, len(p)
        assert _max_diff(w.logits, c.logits) == 0.0, len(p)


@pytest.mark.parametrize("out_features", [259, 256, 7])
def test_bug_42_fp64_linear_rows_do_not_depend_on_the_batch(out_features: int) -> None:
    """The fp64 linear gives each row the same bits whatever else is in the call: M rows at
    once equal the rows one at a time, for any M and any row offset (259 = the tiny LM head:
    with 16-row tiles, MKL's dgemm gave another result at an odd row index than at row 0)."""
    from pymooncake.engine.model.layers import exact_linear
    gen = torch.Generator().manual_seed(0)
    for in_features in (256, 250):
        w = torch.randn(out_features, in_features, generator=gen, dtype=torch.float64)
        x = torch.randn(70, in_features, generator=gen, dtype=torch.float64)
        for weight in (w, w.t().contiguous().t()):  # as stored, and input-major
            alone = torch.cat([exact_linear(x[i:i + 1], weight) for i in range(len(x))])
            for start, m in ((0, 2), (0, 16), (0, 70), (1, 1), (3, 5), (5, 33), (13, 57)):
                rows = exact_linear(x[start:start + m], weight)
                assert torch.equal(rows, alone[start:start + m]), (in_features, start, m)


def test_bug_42_fp64_attention_of_a_token_depends_only_on_its_context() -> None:
    """BUG-42's cause on an AMD EPYC (MKL): the fp64 attention ran ``scores @ V`` and the
    softmax over the whole context, so a token's bits changed with the context length past
    its position (a cold prefill of 44 tokens vs the 17-token prompt that cached its first
    block). Now: the same bits whether the token is one of n query rows over a long context,
    one of a suffix chunk, or decoded alone over exactly its own context."""
    from pymooncake.engine.model.attention import exact_attention
    gen = torch.Generator().manual_seed(1)
    scale = 32 ** -0.5
    for ctx in (17, 44, 64, 65, 130):
        q = torch.randn(ctx, 8, 32, generator=gen, dtype=torch.float64)
        k = torch.randn(2, ctx, 32, generator=gen, dtype=torch.float64)
        v = torch.randn(2, ctx, 32, generator=gen, dtype=torch.float64)
        full = exact_attention(q, k, v, scale)  # a cold prefill of all ctx tokens
        for start in {0, 1, 16, ctx // 2, ctx - 1}:  # a warm prefill of the suffix
            assert torch.equal(exact_attention(q[start:], k, v, scale), full[start:]), (
                ctx, start)
        for p in {0, 5, 16, ctx // 2, ctx - 1}:  # token p alone over its own context
            alone = exact_attention(q[p:p + 1], k[:, :p + 1], v[:, :p + 1], scale)
            assert torch.equal(alone, full[p:p + 1]), (ctx, p)
            prefix = exact_attention(q[:p + 1], k[:, :p + 1], v[:, :p + 1], scale)
            assert torch.equal(prefix, full[:p + 1]), (ctx, p)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(4, 0), v.repeat_interleave(4, 0),
            is_causal=True, scale=scale).transpose(0, 1)
        assert float((full - ref).abs().max()) <= 1e-12


def test_bug_42_fp64_pointwise_and_norm_do_not_depend_on_the_batch() -> None:
    """SiLU/exp (vectorised body vs scalar tail) and RMSNorm: a row's bits are the same in
    a call of any number of rows."""
    from torch.nn import functional as F

    from pymooncake.engine.model.layers import exact_pointwise, exact_rms_norm
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(120, 688, generator=gen, dtype=torch.float64)
    w = 1 + 0.1 * torch.randn(688, generator=gen, dtype=torch.float64)
    for fn in (lambda t: exact_pointwise(F.silu, t), lambda t: exact_pointwise(torch.exp, t),
               lambda t: exact_rms_norm(t, w, 1e-5)):
        alone = torch.cat([fn(x[i:i + 1]) for i in range(len(x))])
        for start, m in ((0, 120), (1, 1), (3, 50), (7, 113)):
            assert torch.equal(fn(x[start:start + m]), alone[start:start + m]), (start, m)


def test_output_carries_the_prompts_block_keys_as_identity_computes_them() -> None:
    """``RequestOutput.prompt_block_keys``: the keys the engine hashed for its prefix
    cache, one per full prompt block, equal to ``identity.block_keys`` (the prefill worker
    puts Store blocks under them without hashing the prompt again); ``()`` for a prompt
    of less than one block."""
    engine = make_engine()
    bs = engine.config.block_size
    prompt = random_prompts(1, 3 * bs + 5, 3 * bs + 5, seed=11)[0]
    out = _run(engine, prompt, SamplingParams(max_tokens=2 * bs))   # outputs fill a block
    assert len(out.prompt_block_keys) == 3
    assert list(out.prompt_block_keys) == block_keys(prompt, engine.namespace)
    assert _run(engine, prompt[: bs - 1]).prompt_block_keys == ()
