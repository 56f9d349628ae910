"""Token materialisation: equal hash ids → equal blocks (across processes), different ids →
different blocks, scaled lengths keep block boundaries aligned."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import blake3
import numpy as np
import pytest

from pymooncake.workload import (
    Trace,
    TraceRequest,
    materialize_tokens,
    materialize_trace,
    scaled_length,
)

V = 32_000


def blocks(tokens: list[int], b: int) -> list[tuple[int, ...]]:
    return [tuple(tokens[i:i + b]) for i in range(0, len(tokens), b)]


class TestBlocks:
    def test_equal_ids_equal_blocks_different_ids_different(self) -> None:
        a = materialize_tokens(TraceRequest(0.0, 2048, 1, (0, 1, 2, 3)), vocab_size=V)
        b = materialize_tokens(TraceRequest(0.0, 1800, 1, (0, 1, 9, 10), index=5), vocab_size=V)
        assert len(a) == 2048 and len(b) == 1800
        ba, bb = blocks(a, 512), blocks(b, 512)
        assert ba[0] == bb[0] and ba[1] == bb[1]
        assert ba[2] != bb[2]
        assert len(set(ba)) == 4

    def test_partial_last_block_is_prefix_of_the_ids_stream(self) -> None:
        full = materialize_tokens(TraceRequest(0.0, 1024, 1, (4, 7)), vocab_size=V)
        part = materialize_tokens(TraceRequest(0.0, 700, 1, (4, 7), index=3), vocab_size=V)
        assert part == full[:700]

    def test_first_block_matches_documented_stream(self) -> None:
        # module docstring: BLAKE3 XOF of b"pymooncake.workload.block/v1:" + f"{seed}:{id}",
        # little-endian uint32 words, reserved_low + w % (vocab_size - reserved_low)
        toks = materialize_tokens(TraceRequest(0.0, 8, 1, (42,)), vocab_size=1000,
                                  block_size=8, seed=3, reserved_low=10)
        raw = blake3.blake3(b"pymooncake.workload.block/v1:3:42").digest(length=32)
        words = [int.from_bytes(raw[i:i + 4], "little") for i in range(0, 32, 4)]
        assert toks == [10 + w % 990 for w in words]

    def test_tail_after_hashed_blocks_comes_from_request_index(self) -> None:
        r1 = TraceRequest(0.0, 600, 1, (1,), index=1)
        r2 = TraceRequest(0.0, 600, 1, (1,), index=2)
        t1, t2 = (materialize_tokens(r, vocab_size=V) for r in (r1, r2))
        assert t1[:512] == t2[:512] and t1[512:] != t2[512:]
        assert materialize_tokens(r1, vocab_size=V) == t1

    def test_seed_vocab_reserved(self) -> None:
        r = TraceRequest(0.0, 4096, 1, tuple(range(8)))
        t = np.array(materialize_tokens(r, vocab_size=300, reserved_low=256))
        assert t.min() >= 256 and t.max() < 300
        assert len(np.unique(t)) == 44  # 4096 draws cover the 44 allowed ids
        assert materialize_tokens(r, vocab_size=V, seed=1) != materialize_tokens(r, vocab_size=V)

    def test_many_ids_distinct_blocks(self) -> None:
        r = TraceRequest(0.0, 16 * 2000, 1, tuple(range(2000)))
        toks = materialize_tokens(r, vocab_size=V, block_size=16)
        assert len(set(blocks(toks, 16))) == 2000


class TestScale:
    @pytest.mark.parametrize("scale", [1, 2, 8, 64, 512])
    def test_scaled_blocks_stay_aligned(self, scale: int) -> None:
        a = TraceRequest(0.0, 6758, 10, tuple(range(14)))
        b = TraceRequest(0.0, 7322, 10, (0, 1, 2, 99) + tuple(range(100, 111)), index=1)
        ta = materialize_tokens(a, vocab_size=V, scale=scale)
        tb = materialize_tokens(b, vocab_size=V, scale=scale)
        sb = 512 // scale
        assert len(ta) == math_ceil(6758, scale) and len(tb) == math_ceil(7322, scale)
        # shared ids 0,1,2 → first three scaled blocks equal, block 3 differs
        assert ta[:3 * sb] == tb[:3 * sb]
        assert ta[3 * sb:4 * sb] != tb[3 * sb:4 * sb]
        # the scaled block of id i is the first sb tokens of its unscaled block
        full = materialize_tokens(a, vocab_size=V)
        for i in range(13):
            assert ta[i * sb:(i + 1) * sb] == full[i * 512:i * 512 + sb]

    def test_bad_arguments(self) -> None:
        r = TraceRequest(0.0, 100, 1, (1,))
        for kwargs, match in [
            (dict(scale=3), "multiple of scale"), (dict(scale=0), "scale must be an int >= 1"),
            (dict(vocab_size=1), "vocab_size"), (dict(reserved_low=-1), "reserved_low"),
            (dict(vocab_size=257, reserved_low=256), "vocab_size must be an int >= 258"),
            (dict(seed=-1), "seed"), (dict(block_size=0), "block_size"),
            (dict(vocab_size=1000.0), "vocab_size"),
        ]:
            args = dict(vocab_size=V) | kwargs
            with pytest.raises(ValueError, match=match):
                materialize_tokens(r, **args)  # type: ignore[arg-type]

    def test_materialize_trace(self) -> None:
        reqs = (TraceRequest(0.0, 1000, 101, (1, 2)), TraceRequest(5.0, 600, 0, (1, 3), index=1))
        out = materialize_trace(Trace(reqs), vocab_size=V, scale=4)
        assert [m.index for m in out] == [0, 1]
        assert [len(m.token_ids) for m in out] == [250, 150]
        assert [m.max_tokens for m in out] == [26, 0]
        assert out[0].block_size == 128 and out[1].timestamp_ms == 5.0
        assert out[0].token_ids[:128] == out[1].token_ids[:128]
        assert list(out[0].token_ids) == materialize_tokens(reqs[0], vocab_size=V, scale=4)
        assert scaled_length(1000, 4) == 250 and scaled_length(1001, 4) == 251


def math_ceil(n: int, d: int) -> int:
    return -(-n // d)


_CHILD = textwrap.dedent("""
    import json
    from pymooncake.workload import TraceRequest, materialize_tokens
    r = TraceRequest(0.0, 1300, 1, (5, 6, 7), index=4)
    print(json.dumps([materialize_tokens(r, vocab_size=50_000, scale=s) for s in (1, 4)]))
""")


def test_deterministic_across_processes() -> None:
    outs = []
    for seed in (None, "123"):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        if seed is not None:
            env["PYTHONHASHSEED"] = seed
        p = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                           env=env, timeout=60, check=False)
        assert p.returncode == 0, p.stderr
        outs.append(json.loads(p.stdout))
    assert outs[0] == outs[1]
    r = TraceRequest(0.0, 1300, 1, (5, 6, 7), index=4)
    assert outs[0][0] == materialize_tokens(r, vocab_size=50_000)
